"""An SAE's encoder, read from its folder as each library writes it, to rank its features by how strongly they fire
on a prompt set (a sweep's `top: K`). Numpy and safetensors only; the encoder is read a block of features at a time.

    sae_lens   W_enc [d_in, d_sae], b_enc; x - b_dec first (cfg apply_b_dec_to_input, default true); cfg
               `architecture`: standard (relu), jumprelu (relu where pre > the `threshold` tensor), topk (cfg `k`:
               the k largest pre-activations per token, relu'd; rescale_acts_by_decoder_norm multiplies pre by
               |W_dec[f]|); sae-lens 5's activation_fn_str: topk (activation_fn_kwargs.k) reads as topk
    sparsify   encoder.weight [num_latents, d_in], encoder.bias; x - b_dec first; relu, then cfg `activation`: topk
               (the k largest per token) or groupmax (the largest of each of k contiguous groups)
    goodfire   encoder_linear.weight [d_sae, d_in], encoder_linear.bias; relu (no b_dec)

Anything else (gated SAEs, transcoders, input normalisation other than none) is a one-line `SaeError`: list the
features instead."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from driver.steering.saes import Sae, SaeError, hookpoint_name, read_cfg, read_part, read_sae, site_problem

__all__ = ["Encoder", "read_encoder", "ranking_encoder", "capture_requests", "prompt_weights", "per_prompt", "ranked"]

_BLOCK = 1 << 24  # floats of pre-activations per block of features (64 MiB of float32)


@dataclass(frozen=True)
class Encoder:
    """How to encode with one SAE: f = act((x - shift) · W + bias), W read from `file[weight]` a block at a time."""

    path: Path
    file: Path
    weight: str
    in_first: bool  # W stored [d_in, d_sae] (sae-lens W_enc); else [d_sae, d_in] (an nn.Linear's weight)
    bias: str | None
    shift: np.ndarray | None  # b_dec, subtracted from the input first
    activation: str  # relu | jumprelu | topk | groupmax
    d_sae: int
    k: int | None = None  # topk, groupmax
    threshold: str | None = None  # jumprelu's tensor
    decoder: str | None = None  # topk rescaled by the decoder rows' norms: the decoder's tensor

    def _read(self, key: str, lo: int, hi: int, columns: bool = False) -> np.ndarray:
        try:
            block = read_part(self.file, key, slice(lo, hi), columns)
        except Exception as e:  # safetensors' own errors (bfloat16 for numpy, a truncated file, ...)
            raise SaeError(f"{self.file}: cannot read {key} ({type(e).__name__}: {e}); save the SAE in float32") from None
        block = np.asarray(block, dtype=np.float32)
        if not np.isfinite(block).all():
            raise SaeError(f"{self.file}: {key} holds NaN/inf values (features {lo}..{hi - 1}); this SAE file is damaged")
        return block

    def pre(self, x: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """Pre-activations [tokens, hi - lo] of features lo..hi-1 for inputs x [tokens, d_in] (float32)."""
        w = self._read(self.weight, lo, hi, columns=self.in_first)
        out = (x - self.shift if self.shift is not None else x) @ (w if self.in_first else w.T)
        if self.bias is not None:
            out += self._read(self.bias, lo, hi)
        if self.decoder is not None:
            out *= np.linalg.norm(self._read(self.decoder, lo, hi), axis=1)
        return out

    def _blocks(self, tokens: int) -> list[tuple[int, int]]:
        size = max(1, _BLOCK // max(tokens, 1))
        if self.activation == "groupmax":  # whole groups in a block
            group = self.d_sae // self.k
            size = max(group, size // group * group)
        return [(lo, min(lo + size, self.d_sae)) for lo in range(0, self.d_sae, size)]

    def _kth(self, x: np.ndarray) -> np.ndarray:
        """topk: each token's k-th largest pre-activation over every feature (one pass over the blocks)."""
        best = np.full((len(x), 0), -np.inf, dtype=np.float32)
        for lo, hi in self._blocks(len(x)):
            both = np.concatenate([best, self.pre(x, lo, hi)], axis=1)
            best = np.partition(both, both.shape[1] - self.k, axis=1)[:, -self.k :] if both.shape[1] > self.k else both
        return best.min(axis=1)

    def activations(self, x: np.ndarray, lo: int, hi: int, kth: np.ndarray | None = None) -> np.ndarray:
        """Feature activations [tokens, hi - lo] (lo, hi from whole groups for groupmax; kth from `_kth` for topk)."""
        pre = self.pre(x, lo, hi)
        act = np.maximum(pre, 0)
        if self.activation == "jumprelu":
            act *= pre > self._read(self.threshold, lo, hi)
        elif self.activation == "topk":
            act *= pre >= kth[:, None]
        elif self.activation == "groupmax":
            groups = act.reshape(len(x), -1, self.d_sae // self.k)
            keep = np.zeros_like(groups, dtype=bool)
            np.put_along_axis(keep, groups.argmax(axis=2)[..., None], True, axis=2)
            act = (groups * keep).reshape(len(x), -1)
        return act

    def feature(self, x: np.ndarray, f: int) -> np.ndarray:
        """Feature f's activation at each token of x [tokens, d_in]: [tokens] float64. Only f's block is encoded (the
        block `mean_activation` reads it in: topk's comparison with each token's k-th largest sees the same floats)."""
        x = np.asarray(x, dtype=np.float32)
        lo, hi = next((lo, hi) for lo, hi in self._blocks(len(x)) if lo <= f < hi)
        kth = self._kth(x) if self.activation == "topk" else None
        return self.activations(x, lo, hi, kth)[:, f - lo].astype(np.float64)

    def mean_activation(self, x: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """Σ_t weights[t] · f(x[t]) per feature: [d_sae] float64 (weights: each prompt's tokens share 1 / prompts)."""
        x = np.asarray(x, dtype=np.float32)
        kth = self._kth(x) if self.activation == "topk" else None
        out = np.zeros(self.d_sae, dtype=np.float64)
        for lo, hi in self._blocks(len(x)):
            out[lo:hi] = weights.astype(np.float64) @ self.activations(x, lo, hi, kth).astype(np.float64)
        return out


def _cfg(sae: Sae) -> dict:
    path = sae.path / "cfg.json"
    return {} if sae.layout == "goodfire" or not path.is_file() else read_cfg(path)


def _tensors(file: Path) -> dict[str, list[int]]:
    from safetensors import safe_open

    with safe_open(str(file), framework="np") as f:
        return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}


def _sae_lens(sae: Sae, cfg: dict, shapes: dict) -> dict:
    """The encoder of a sae-lens folder, as its SAE classes' `encode` computes it (a cfg.json naming no architecture:
    jumprelu where the file holds a threshold tensor, which only JumpReLU SAEs save, else standard)."""
    arch = cfg.get("architecture") or ("jumprelu" if "threshold" in shapes else "standard")
    kwargs = cfg.get("activation_fn_kwargs") if isinstance(cfg.get("activation_fn_kwargs"), dict) else {}
    if arch == "standard" and cfg.get("activation_fn_str", cfg.get("activation_fn")) == "topk":  # sae-lens 5
        arch, cfg = "topk", {**cfg, "k": kwargs.get("k")}
    if arch not in ("standard", "jumprelu", "topk"):
        raise SaeError(f"{sae.path}: a sae-lens {arch!r} SAE, whose encoder Orchard does not compute (it reads standard, "
                       "jumprelu and topk): list the features to sweep instead of top")  # fmt: skip
    norm = cfg.get("normalize_activations") or "none"
    if norm != "none":
        raise SaeError(f"{sae.path}: normalize_activations {norm!r}: Orchard encodes unnormalised inputs only; fold the "
                       "normalisation into the weights, or list the features to sweep instead of top")  # fmt: skip
    shift = sae.b_dec if cfg.get("apply_b_dec_to_input", True) else None
    found = {"weight": "W_enc", "in_first": True, "bias": "b_enc", "shift": shift, "activation": "relu" if arch == "standard" else arch}
    if arch == "jumprelu":
        found["threshold"] = "threshold"
    if arch == "topk":
        found["k"] = cfg.get("k")
        found["decoder"] = "W_dec" if cfg.get("rescale_acts_by_decoder_norm") else None
    return found


def _sparsify(sae: Sae, cfg: dict, shapes: dict) -> dict:
    """The encoder of a sparsify folder, as SparseCoder.encode computes it (relu, then top-k or group max)."""
    if cfg.get("transcode"):
        raise SaeError(f"{sae.path}: a transcoder (cfg transcode: true) reads another site than it writes: list the features "
                       "to sweep instead of top")  # fmt: skip
    activation = cfg.get("activation", "topk")
    if activation not in ("topk", "groupmax"):
        raise SaeError(f"{sae.path}: activation {activation!r} is not one sparsify has (topk, groupmax)")
    return {"weight": "encoder.weight", "in_first": False, "bias": "encoder.bias", "shift": sae.b_dec, "activation": activation,
            "k": cfg.get("k", 32)}  # fmt: skip


def read_encoder(sae: Sae) -> Encoder:
    """The encoder of `sae`'s folder, its tensors' shapes checked; a one-line SaeError when it has none Orchard reads."""
    cfg, shapes = _cfg(sae), _tensors(sae.file)
    if sae.layout == "goodfire":
        found = {"weight": "encoder_linear.weight", "in_first": False, "bias": "encoder_linear.bias", "shift": None, "activation": "relu"}
    else:
        found = (_sae_lens if sae.layout == "sae_lens" else _sparsify)(sae, cfg, shapes)
    d_sae, d_in = sae.shape
    if found["weight"] not in shapes:
        raise SaeError(f"{sae.file}: no encoder ({found['weight']}): this SAE was saved with its decoder only, so its features "
                       "cannot be ranked or measured: list `features:` instead of `top:`, without `prompts:`")  # fmt: skip
    want = {found["weight"]: [d_in, d_sae] if found["in_first"] else [d_sae, d_in], found["bias"]: [d_sae],
            found.get("threshold"): [d_sae]}  # fmt: skip
    for key, shape in want.items():
        if key is not None and key != found["bias"] and key not in shapes:
            raise SaeError(f"{sae.file}: no {key} tensor, which a {found['activation']} encoder needs")
        if key in shapes and shapes[key] != shape:
            raise SaeError(f"{sae.file}: {key} has shape {shapes[key]}, not {shape} (d_in {d_in}, d_sae {d_sae})")
    found["bias"] = found["bias"] if found["bias"] in shapes else None
    k = found.get("k")
    if found["activation"] in ("topk", "groupmax") and not (isinstance(k, int) and 0 < k <= d_sae and (found["activation"] == "topk" or d_sae % k == 0)):
        raise SaeError(f"{sae.path}: cfg.json's k ({k!r}) is not a number of features this {d_sae}-feature {found['activation']} SAE keeps")
    encoder = Encoder(sae.path, sae.file, d_sae=d_sae, **found)
    if encoder.threshold:  # [d_sae] floats: checked now, before any prompt is captured
        encoder._read(encoder.threshold, 0, d_sae)
    return encoder


def ranking_encoder(path: Path, site: str, layer: int, hidden: int | None) -> Encoder:
    """The encoder of the SAE at `path` (a sparsify run: its folder for this site) that ranks features for an
    intervention at (site, layer), checked: the SAE reads that site, is the model's width, and has an encoder."""
    sae = read_sae(path, hookpoint_name(site, layer))
    problem = site_problem(sae, site, layer)
    if problem:
        raise SaeError(problem)
    if hidden and sae.width != hidden:
        raise SaeError(f"the SAE at {sae.path} is {sae.width} wide (d_in) but the model's hidden size is {hidden}: use an SAE trained on this model")
    return read_encoder(sae)


def capture_requests(token_lists: Sequence[Sequence[int]], prefix: int | None) -> tuple[list[tuple[tuple[int, ...], int]], np.ndarray]:
    """Capture requests (tokens, position) for every token of every prompt but a leading `prefix` (the BOS token reads
    the same for every prompt), and which prompt each one reads (its index in `token_lists`)."""
    requests, owners = [], []
    for n, tokens in enumerate(token_lists):
        tokens = tuple(int(t) for t in tokens)
        first = 1 if len(tokens) > 1 and tokens[0] == prefix else 0
        requests += [(tokens, p) for p in range(first, len(tokens))]
        owners += [n] * (len(tokens) - first)
    return requests, np.asarray(owners, dtype=np.int64)


def prompt_weights(owners: np.ndarray) -> np.ndarray:
    """Each token's weight, 1 / (prompts × its prompt's tokens): the mean over prompts of each prompt's mean."""
    counts = np.bincount(owners)
    return 1.0 / (np.count_nonzero(counts) * counts[owners])


def per_prompt(values: np.ndarray, owners: np.ndarray) -> np.ndarray:
    """Each prompt's mean of `values` (one per token) over its tokens."""
    counts = np.bincount(owners)
    return np.bincount(owners, weights=values)[counts > 0] / counts[counts > 0]


def ranked(means: np.ndarray, k: int, where: str = "the SAE") -> list[tuple[int, float]]:
    """The k features of highest mean activation, (feature, mean), highest first (ties: the lower index first);
    SaeError when fewer than k fire at all on the prompts (the rest would be picked by index, not activation)."""
    active = int(np.count_nonzero(means > 0))
    if active < k:
        said = "no feature of " + where + " is active" if not active else f"only {active} feature(s) of {where} are active"
        raise SaeError(f"{said} on the prompts (mean activation > 0), fewer than top: {k}: lower top, or use prompts "
                       "where the SAE's features fire (or another SAE)")  # fmt: skip
    order = np.lexsort((np.arange(len(means)), -means))[:k]
    return [(int(f), float(means[f])) for f in order]
