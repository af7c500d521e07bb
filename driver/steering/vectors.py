"""Steering vectors from contrastive pairs (CAA-style): read pairs, capture activations, combine, write.

Pure numpy plus a tokenizer's `encode`; where the capture runs (in process, across Ray workers) is the
caller's `capture_fn(requests, points) -> [ [points, hidden] arrays ]`, so extraction means the same anywhere.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from worker.spec import HEAD_SITES, NEGATIVE_HEAD, SITES

from driver.checks.files import write_atomic
from driver.checks.settings import integer
from driver.steering.userfiles import json_object, jsonl_lines

METHODS = ("mean-diff", "pca-diff", "pca-center")
_FIELDS = ("prompt", "positive", "negative")


class PairsError(ValueError):
    """A pairs file that cannot be used; the one-line message names the file (and line)."""


@dataclass(frozen=True)
class Pair:
    """One contrastive pair; both sides continue the same (possibly empty) prompt."""

    positive: str
    negative: str
    prompt: str = ""
    line: int = field(default=0, compare=False)  # in the pairs file (0: not from a file)

    @property
    def where(self) -> str:
        return f"line {self.line}" if self.line else "a pair"

    @property
    def texts(self) -> tuple[str, str]:
        return self.prompt + self.positive, self.prompt + self.negative


# --- inputs -------------------------------------------------------------------------------------------


def _pair(obj, where: str, line: int = 0) -> Pair:
    json_object(obj, _FIELDS, where, PairsError, "positive and negative")
    for key in _FIELDS:
        if key in obj and not isinstance(obj[key], str):
            raise PairsError(f"{where}: field {key!r} must be a string, not {type(obj[key]).__name__}")
    for key in ("positive", "negative"):
        if not obj.get(key):
            raise PairsError(f"{where}: {'empty' if key in obj else 'missing'} field {key!r}")
    return Pair(obj["positive"], obj["negative"], obj.get("prompt", ""), line)


def read_pairs(path: str | os.PathLike) -> list[Pair]:
    """Pairs from JSONL: one {"positive": ..., "negative": ..., optional "prompt": ...} per line; blank lines skipped."""
    path = Path(path)
    lines = jsonl_lines(path, PairsError, f"pairs file not found: {path}", f"pairs file is a folder: {path}")
    pairs = [_pair(obj, f"{path}: line {n}", n) for n, obj in lines]
    if not pairs:
        raise PairsError(f"{path}: no pairs (the file is empty): write one JSON object per line")
    return pairs


def pairs_sha256(pairs: Sequence[Pair]) -> str:
    """Digest of the pairs' content (not the file's formatting), for the vectors' metadata."""
    rows = [[p.prompt, p.positive, p.negative] for p in pairs]
    return hashlib.sha256(json.dumps(rows, ensure_ascii=False).encode()).hexdigest()


def parse_layers(spec: str, n_layers: int, what: str = "layer") -> list[int]:
    """"all" or comma-separated layers ("2,3,4"; "-1": the last block), resolved to 0..n_layers-1, in order.
    `what`: what the numbers count ("head" for --heads: heads never count from the end, `NEGATIVE_HEAD`)."""
    spec = spec.strip()
    if spec == "all":
        return list(range(n_layers))
    layers: list[int] = []
    for item in spec.split(","):
        layer = integer(item)  # ASCII digits only, as every whole number (Python's int() reads 1_0 as 10)
        if layer is None:
            like = "0,3" if what == "head" else "2,3,4 or -1"  # heads never count from the end
            raise ValueError(f"bad {what} {item.strip()!r} in {spec!r}: use 'all' or integers like {like}")
        if what == "head" and layer < 0:
            raise ValueError(f"head {layer}: {NEGATIVE_HEAD}: give 0..{n_layers - 1} or all")
        if not -n_layers <= layer < n_layers:
            raise ValueError(
                f"{what} {layer} is out of range: the model has {n_layers} {what}s "
                f"(0..{n_layers - 1}{'' if what == 'head' else f' or -{n_layers}..-1'})"
            )
        layer %= n_layers
        if layer in layers:
            raise ValueError(f"{what} {layer} is given twice in {spec!r}")
        layers.append(layer)
    return layers


def parse_position(spec: str) -> int:
    """"last" (-1) or a token index: negative counts from the end (-2: the token before the last)."""
    spec = spec.strip()
    if spec == "last":
        return -1
    position = integer(spec)
    if position is None:
        raise ValueError(f"bad position {spec!r}: use 'last' or a token index like -2 or 5")
    return position


def _position_problem(n: int, position: int, max_length: int | None) -> str | None:
    """Why `position` cannot be read in n tokens of which the model keeps the last max_length; None if it can."""
    at = position + n if position < 0 else position
    if not 0 <= at < n:
        return f"is outside the {n} tokens of"
    cut = max(0, n - max_length) if max_length else 0
    if at < cut:
        return f"falls in the first {cut} tokens, cut off to fit the model's context of {max_length}, of the {n} tokens of"
    return None


def capture_requests(
    encode: Callable[[str], list[int]], pairs: Sequence[Pair], position: int, max_length: int | None = None
) -> list[tuple[tuple[int, ...], int]]:
    """Capture requests, positives first then negatives: request i is pair i's positive, n + i its negative.

    Every pair's position is checked (as the capture resolves it: the last `max_length` tokens are kept) and
    the first pair where it cannot be read is a PairsError naming its line, before anything runs."""
    requests: list[list] = [[], []]
    for k, pair in enumerate(pairs):
        for side in (0, 1):
            tokens = tuple(encode(pair.texts[side]))
            problem = _position_problem(len(tokens), position, max_length)
            if problem:
                where = pair.where if pair.line else f"pair {k + 1}"
                raise PairsError(f"{where}: position {position} {problem} its {('positive', 'negative')[side]} text")
            requests[side].append((tokens, position))
    return requests[0] + requests[1]


def check_method(method: str, n_pairs: int) -> None:
    """The PCA methods find how pairs vary: one pair has no variation to find."""
    if method in ("pca-diff", "pca-center") and n_pairs < 2:
        raise PairsError(f"{method} needs at least 2 pairs (it finds how they vary), the file has {n_pairs}: add pairs or use mean-diff")


def same_sides(requests: Sequence[tuple[tuple[int, ...], int]], pairs: Sequence[Pair]) -> list[Pair]:
    """Pairs whose two texts are the same tokens: their difference is zero at every layer."""
    n = len(pairs)
    return [pair for k, pair in enumerate(pairs) if requests[k] == requests[n + k]]


def same_at_position(requests: Sequence[tuple[tuple[int, ...], int]], pairs: Sequence[Pair], max_length: int | None) -> list[Pair]:
    """Pairs whose two texts agree on every token up to the read position (of what the model keeps): a causal
    model's activations there are then the same (--position 0 reads the BOS token of both), so the difference is zero."""
    def upto(tokens: tuple[int, ...], position: int) -> tuple[int, ...]:
        kept = tokens[-max_length:] if max_length else tokens
        return kept[: (position % len(kept) if position < 0 else position - (len(tokens) - len(kept))) + 1]

    n = len(pairs)
    return [pair for k, pair in enumerate(pairs) if upto(*requests[k]) == upto(*requests[n + k])]


def truncated(requests: Sequence[tuple[tuple[int, ...], int]], max_length: int) -> int:
    """How many capture texts are longer than the model's context (the capture keeps their last max_length tokens)."""
    return sum(len(tokens) > max_length for tokens, _ in requests)


def head_encoder(folder: Path, trust_remote_code: bool = False) -> Callable[[str], list[int]]:
    """`OrchardLM.tok_encode` on the model's tokenizer without a model (memoised): the head tokenizes and checks
    the pairs before any worker starts, and the capture then runs on exactly these tokens."""
    from driver.lm.mlx import OrchardLM
    from driver.lm.model_setup import load_tokenizer

    class _Head:  # the attributes tok_encode reads, nothing else of an lm-eval model
        tok_encode = OrchardLM.tok_encode
        prefix_token_id = OrchardLM.prefix_token_id
        tokenizer = load_tokenizer(folder, trust_remote_code)

    return functools.lru_cache(maxsize=None)(_Head().tok_encode)


def check_pairs(path: str | os.PathLike, pairs: Sequence[Pair], encode: Callable[[str], list[int]], method: str,
                position: int, max_length: int) -> None:  # fmt: skip
    """Everything about the pairs the head can know before capture, as one-line PairsErrors naming the file
    (and line): the method's pair count, the position in every text, pairs whose sides are the same tokens.
    Texts longer than the model's context are said once, on stderr (the capture keeps their last tokens)."""
    try:
        check_method(method, len(pairs))
        requests = capture_requests(encode, pairs, position, max_length)
    except PairsError as e:
        raise PairsError(f"{path}: {e}") from None
    same = same_sides(requests, pairs)
    if same:
        more = f" (so are lines {_lines(same[1:])})" if len(same) > 1 else ""
        raise PairsError(
            f"{path}: {same[0].where}: the positive and negative texts are the same tokens{more}, so their "
            "difference is zero at every layer: make the two sides of each pair differ"
        )
    alike = same_at_position(requests, pairs, max_length)
    if len(alike) == len(pairs):
        raise PairsError(
            f"{path}: the positive and negative texts of every pair agree on every token up to position {position}, so "
            "the activations read there are the same and every vector would be zero: read a position where the texts "
            "differ (e.g. --position last)"
        )
    long = truncated(requests, max_length)
    if long:
        print(f"warning: {long} of {len(requests)} pair texts are longer than the model's context ({max_length} "
              f"tokens); the capture reads their last {max_length} tokens", file=sys.stderr)  # fmt: skip


# --- combining ----------------------------------------------------------------------------------------


def _top_direction(x: np.ndarray, method: str) -> np.ndarray:
    """Unit first right-singular vector of x (float64); deterministic for a given input."""
    _, s, vt = np.linalg.svd(x, full_matrices=False)
    if s.size == 0 or s[0] <= 1e-12 * max(1.0, float(np.abs(x).max(initial=0.0))):
        raise ValueError(f"{method}: the activations do not vary, so there is no principal direction (use mean-diff)")
    return vt[0] / np.linalg.norm(vt[0])


def combine(pos: np.ndarray, neg: np.ndarray, method: str) -> np.ndarray:
    """One float32 [d] vector from paired [n, d] activations (computed in float64).

    mean-diff: mean over pairs of pos - neg (CAA); keeps its natural scale.
    pca-diff: first principal component of the differences pos - neg, centred first (as sklearn's PCA does
        in repeng): the direction along which the pairs' differences vary most. A shift shared by every
        pair has no variance, so pca-diff cannot see it; mean-diff and pca-center can. Needs 2+ pairs.
    pca-center: first principal component of each pair's pos and neg minus the pair's mean, stacked.
    PCA directions are unit norm, signed so that positives project higher than negatives on average.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
    pos, neg = np.asarray(pos, dtype=np.float64), np.asarray(neg, dtype=np.float64)
    if pos.ndim != 2 or pos.shape != neg.shape or pos.shape[0] == 0:
        raise ValueError(f"need matching non-empty [n, d] positives and negatives, not {pos.shape} and {neg.shape}")
    if not (np.isfinite(pos).all() and np.isfinite(neg).all()):
        raise ValueError("the activations hold NaN or inf values")
    diff = pos - neg
    mean_diff = diff.mean(axis=0)
    if method == "mean-diff":
        return mean_diff.astype(np.float32)
    if method == "pca-diff":
        check_method(method, len(diff))
        v = _top_direction(diff - mean_diff, method)
    else:
        center = (pos + neg) / 2
        v = _top_direction(np.concatenate([pos - center, neg - center]), method)
    # The SVD's sign is arbitrary: point it from negatives to positives (ties: largest component positive).
    side = float(mean_diff @ v)
    if side < 0 or (side == 0 and v[np.argmax(np.abs(v))] < 0):
        v = -v
    return v.astype(np.float32)


# --- glue and output ----------------------------------------------------------------------------------


def extract(
    capture_fn: Callable[[list, list[str]], list[np.ndarray]],
    encode: Callable[[str], list[int]],
    pairs: Sequence[Pair],
    layers: Sequence[int],
    site: str,
    method: str,
    position: int,
    heads: Sequence[int] = (),
    head_dim: int | None = None,
) -> dict[str, np.ndarray]:
    """{f"{site}.{layer}": float32 [hidden] vector} for resolved (non-negative) layers; at attn_head one
    `attn_head.{layer}.{head}` [head_dim] vector per layer and head of `heads`, each combined on its own."""
    if site not in SITES:
        raise ValueError(f"unknown site {site!r}: choose one of {', '.join(SITES)}")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
    if not pairs or not layers:
        raise ValueError("extract needs at least one pair and one layer")
    points = [f"{site}.{int(layer)}" for layer in layers]
    requests = capture_requests(encode, pairs, position)
    acts = capture_fn(requests, points)
    if len(acts) != len(requests):
        raise RuntimeError(f"the capture returned {len(acts)} results for {len(requests)} requests")
    acts = np.stack([np.asarray(a, dtype=np.float32) for a in acts])  # [2n, points, hidden]
    if site in HEAD_SITES:
        acts, points = per_head(acts, points, heads, head_dim)
    n = len(pairs)
    problem = zero_vectors(acts, pairs, points, position, method)
    if problem:
        raise PairsError(problem)
    return {point: combine(acts[:n, j], acts[n:, j], method) for j, point in enumerate(points)}


def per_head(acts: np.ndarray, points: Sequence[str], heads: Sequence[int], head_dim: int | None) -> tuple[np.ndarray, list[str]]:
    """[2n, points, heads*d] captured at attn_head.L -> [2n, points*len(heads), d], named attn_head.L.h."""
    width = acts.shape[-1]
    if not heads or not head_dim or width % head_dim or max(heads) >= width // head_dim:
        raise ValueError(f"attn_head captured {width} values per token, not heads {list(heads)} of head_dim {head_dim}")
    split = acts.reshape(*acts.shape[:2], width // head_dim, head_dim)[:, :, list(heads)]
    return split.reshape(acts.shape[0], -1, head_dim), [f"{p}.{h}" for p in points for h in heads]


NEAR_ZERO = 1e-4  # of the activations' mean norm: float32 noise from batching is ~1e-7 of it


def _lines(pairs: Sequence[Pair], limit: int = 5) -> str:
    shown = ", ".join(str(p.line) if p.line else "?" for p in pairs[:limit])
    return shown + (f" and {len(pairs) - limit} more" if len(pairs) > limit else "")


def zero_vectors(acts: np.ndarray, pairs: Sequence[Pair], points: Sequence[str], position: int, method: str) -> str | None:
    """Why some layer's vector would be zero or near-zero (relative to its activations), naming the layers and
    the pairs whose two sides read the same there; None when every layer has a direction.

    `acts`: [2n, points, hidden], positives first. A layer where every pair reads the same on both sides has
    no direction for any method; mean-diff's vector is also ~0 where the pairs' differences cancel out."""
    n = len(pairs)
    x = acts.astype(np.float64)
    scale = np.linalg.norm(x, axis=-1).mean(axis=0)  # [points]
    diff = x[:n] - x[n:]
    same = np.linalg.norm(diff, axis=-1) <= NEAR_ZERO * scale  # [n, points]
    flat = np.linalg.norm(diff.mean(axis=0), axis=-1) <= NEAR_ZERO * scale  # [points]
    zero = [j for j in range(len(points)) if same[:, j].all() or (method == "mean-diff" and flat[j])]
    if not zero:
        return None
    culprits = [pairs[k] for k in range(n) if same[k, zero].all()]
    why = (f"the pairs on lines {_lines(culprits)} read the same activations on both sides at position {position}; "
           "make their positive and negative texts differ there" if culprits else
           "the pairs' differences cancel out; check that every pair has its positive side first")  # fmt: skip
    named = ", ".join(points[j] for j in zero)
    return f"the vectors at {named} would be zero (under {NEAR_ZERO:g} of the activations' norm): {why}; nothing written"


def orchard_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("orchard")
    except PackageNotFoundError:
        return "unknown"


def metadata(model: str, method: str, site: str, position: int, pairs: Sequence[Pair], **extra: str) -> dict[str, str]:
    """The string metadata stored with the vectors; `extra` adds e.g. the weights' fingerprint."""
    return {
        "model": str(model),
        "method": method,
        "site": site,
        "position": str(position),
        "n_pairs": str(len(pairs)),
        "pairs_sha256": pairs_sha256(pairs),
        "orchard_version": orchard_version(),
        **{k: str(v) for k, v in extra.items()},
    }


def write_vectors(path: str | os.PathLike, vectors: dict[str, np.ndarray], metadata: dict[str, str]) -> Path:
    """Write one .safetensors file atomically, readable as the umask says (checks.files.write_atomic)."""
    from safetensors.numpy import save  # bytes: save_file makes its own file, 0600

    path = Path(path)
    if path.is_dir():
        raise ValueError(f"output path is a folder: {path} (give a file name such as vectors.safetensors)")
    if not vectors:
        raise ValueError("no vectors to write")
    bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise ValueError(f"metadata {bad[0]!r} must map a string to a string")
    tensors = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in vectors.items()}
    meta = {"orchard_version": orchard_version(), **metadata}
    return write_atomic(path, save(tensors, metadata=meta))
