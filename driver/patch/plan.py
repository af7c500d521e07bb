"""The plan of a patch run: its file checked against the model (layers, positions, heads, the family's sites) and
its pairs (tokenized on the head), and every (pair, cell) request, each pair's cells contiguous. Starts no worker."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from worker.patch.spec import PatchCell, PatchRequest
from worker.spec import head_shape, site_missing

from driver.patch.pairs import Pair, read_pairs, same_length, tokenize
from driver.patch.schema import PatchError, PatchFile, read_patch_file

__all__ = ["Patch", "load_patch"]


@dataclass
class Patch:
    """A checked patch run: the file, the model's arguments, the tokenized pairs and the grid of cells."""

    path: Path
    spec: PatchFile
    model_args: dict
    n_layers: int
    pairs: list[Pair]
    cells: list[PatchCell]  # methods x sites x layers x positions (heads at attn_head), in that order
    pairs_file: Path
    labels: list[str]  # each position's token (clean/corrupt where the first pair's differ)

    def first_pass(self) -> list[PatchRequest]:
        """One request per pair without a cell: its clean and corrupt logit differences."""
        return [_request(p, None) for p in self.pairs]

    def requests(self) -> list[PatchRequest]:
        """Every (pair, cell), pair by pair: the cells of one pair are contiguous, so they stay in few chunks."""
        return [_request(p, c) for p in self.pairs for c in self.cells]


def _request(pair: Pair, cell: PatchCell | None) -> PatchRequest:
    return PatchRequest(clean=pair.clean_ids, corrupt=pair.corrupt_ids, correct=pair.correct_id, wrong=pair.wrong_id, cell=cell)


def _resolve(values, count: int, what: str, where: str, *, owner: str, from_end: bool = True) -> list[int]:
    """`all` or a list (negative: from the end) resolved to 0..count-1, each once; `owner` says how many there are ({n})."""
    if values == "all":
        return list(range(count))
    out = []
    for v in values:
        if not (-count if from_end else 0) <= v < count:
            ends = f" or -{count}..-1 from the end" if from_end else ""
            raise PatchError(f"{where}: {what}: {v} is out of range: {owner.format(n=count)} (use 0..{count - 1}{ends})")
        if v % count in out:
            raise PatchError(f"{where}: {what}: {v} is {v % count}, which is already listed")
        out.append(v % count)
    return out


def _positions(spec: PatchFile, length: int, where: str) -> list[int]:
    """Token positions from 0 (the BOS where the tokenizer adds one); `last` and negatives count from the end."""
    if spec.positions == "last":
        return [length - 1]
    return _resolve(spec.positions, length, "positions", where, owner="every pair has {n} tokens")


def _check_sites(spec: PatchFile, config: dict, layers: list[int], where: str) -> None:
    """A site the model's blocks lack (read off its blocks built without weights, as driver.checks.model.check_site)."""
    from worker.hooks.skeleton import missing_sites

    missing = missing_sites(config)
    for site in spec.sites:
        gap = next((why for layer in layers if (why := site_missing(missing, site, layer))), None)
        if gap:
            raise PatchError(f"{where}: sites: {site}: {gap}")


def _heads(spec: PatchFile, config: dict, where: str) -> list[int]:
    if "attn_head" not in spec.sites:
        if "heads" in spec.model_fields_set:
            raise PatchError(f"{where}: heads: only the attn_head site has heads: add attn_head to sites, or remove heads")
        return []
    return _resolve(spec.heads, head_shape(config)[0], "heads", where, owner="the model has {n} attention heads", from_end=False)


def _cells(spec: PatchFile, layers: list[int], positions: list[int], heads: list[int]) -> list[PatchCell]:
    out = []
    for method in spec.method:
        for site in spec.sites:
            for layer in layers:
                if site == "attn_head":
                    out += [PatchCell(site=site, layer=layer, head=h, method=method) for h in heads]
                else:
                    out += [PatchCell(site=site, layer=layer, position=p, method=method) for p in positions]
    return out


def _labels(pair: Pair, decode) -> list[str]:
    """Each position's token as text, `clean/corrupt` where the pair differs (the heatmaps' axis)."""
    return [decode(c) if c == k else f"{decode(c)}/{decode(k)}" for c, k in zip(pair.clean_ids, pair.corrupt_ids)]


def _model_args(spec: PatchFile, base: Path) -> dict:
    """The model's arguments for `mlx-ray`, as a sweep file's model section gives them (paths from the file's folder)."""
    m = spec.model
    args = {k: v for k, v in m.model_dump().items() if v is not None and k not in ("threads", "group_size", "split")}
    near = base / Path(m.pretrained).expanduser()
    args["pretrained"] = str(near.resolve()) if not Path(m.pretrained).is_absolute() and near.exists() else m.pretrained
    if m.adapter_path is not None:
        args["adapter_path"] = str((base / Path(m.adapter_path).expanduser()).resolve())
    if m.threads is not None:
        args["threads"] = m.threads
    return args


def load_patch(path: str | os.PathLike) -> Patch:
    """Read and check a patch file against its model and pairs; starts no worker. Raises PatchError (one line),
    or driver.checks' Refused for the model folder and its tokenizer."""
    from worker.load import context_window, model_shape

    from driver.checks.model import check_model, check_tokenizer, model_config
    from driver.steering.vectors import head_encoder

    path = Path(path).expanduser()
    where, spec = str(path), read_patch_file(path)
    args = _model_args(spec, path.absolute().parent)
    folder = check_model(args["pretrained"], args.get("revision"), args.get("adapter_path"))
    check_tokenizer(folder)
    config = model_config(folder)
    n_layers = model_shape(config)[0]
    if n_layers is None:
        raise PatchError(f"{where}: model.pretrained: the model's config.json does not give its number of layers")
    layers = _resolve(spec.layers, n_layers, "layers", where, owner="the model has {n} layers")
    _check_sites(spec, config, layers, where)
    heads = _heads(spec, config, where)
    pairs_file = path.absolute().parent / Path(spec.pairs).expanduser()
    encode = head_encoder(folder, spec.model.trust_remote_code)
    pairs = tokenize(read_pairs(pairs_file, where), encode, pairs_file, context_window(config, spec.model.max_length))
    by_position = any(s != "attn_head" for s in spec.sites)
    positions = _positions(spec, same_length(pairs, pairs_file), where) if by_position else []
    tokenizer = encode.__wrapped__.__self__.tokenizer  # the one head_encoder loaded (lru_cache wraps its bound method)
    labels = _labels(pairs[0], lambda i: tokenizer.decode([i])) if by_position else []
    return Patch(path, spec, args, n_layers, pairs, _cells(spec, layers, positions, heads), pairs_file, labels)
