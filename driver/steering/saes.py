"""Sparse autoencoders read from local folders, for their decoder directions: a feature as a steering vector.

Three layouts, each as its library writes it (numpy and safetensors only: no torch, sparsify or sae_lens):

    sae_lens   cfg.json + sae_weights.safetensors   W_dec [d_sae, d_in], b_dec [d_in]; the site in cfg.json's
                                                    `hook_name` (top level, or under `metadata` since sae-lens 6)
    sparsify   cfg.json + sae.safetensors           W_dec [num_latents, d_in], b_dec [d_in]; the site is the
                                                    folder's name, an lm-eval hookpoint (`layers.3`, `layers.3.mlp`)
    goodfire   one .safetensors with decoder_linear.weight [d_in, d_sae] (an nn.Linear: feature f is column f),
               decoder_linear.bias [d_in]; no site recorded

A folder of sparsify hookpoint folders (as sparsify saves a run) is accepted too: the one for the intervention's
hookpoint is used. Every problem is a one-line `SaeError`; a site name is read by `site_of`, in lm-eval's
(HF module) names or TransformerLens' (`blocks.L.hook_resid_post`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["Sae", "SaeError", "read_sae", "read_part", "site_of", "hookpoint_name", "same_site", "site_problem"]

_HF = re.compile(r"^(?:model\.)?(?:layers|h)\.(\d+)(?:\.(self_attn|attn|mlp|self_attn\.o_proj))?$")
_HF_SITES = {None: "resid_post", "self_attn": "attn_out", "attn": "attn_out", "self_attn.o_proj": "attn_out", "mlp": "mlp_out"}
_TL = re.compile(r"^blocks\.(\d+)\.(hook_resid_pre|hook_resid_mid|hook_resid_post|hook_attn_out|hook_mlp_out|attn\.hook_z)$")
_TL_SITES = {"hook_resid_pre": "resid_pre", "hook_resid_mid": "resid_mid", "hook_resid_post": "resid_post",
             "hook_attn_out": "attn_out", "hook_mlp_out": "mlp_out", "attn.hook_z": "attn_head"}  # fmt: skip
HOOKPOINTS = "layers.L (block output), layers.L.self_attn (attention output), layers.L.mlp, or blocks.L.hook_resid_post"


class SaeError(ValueError):
    """An SAE folder or feature that cannot be used; the message is one line naming the path and the fix."""


def site_of(name: str) -> tuple[str, int] | None:
    """(site, layer) of a hook name in lm-eval's module names or TransformerLens'; None if it is neither."""
    m = _HF.match(name.strip())
    if m:
        return _HF_SITES[m.group(2)], int(m.group(1))
    m = _TL.match(name.strip())
    return (_TL_SITES[m.group(2)], int(m.group(1))) if m else None


def hookpoint_name(site: str, layer: int) -> str:
    """lm-eval's (HF llama's) module name for a site: the name a sparsify run's folder has."""
    return {"resid_post": f"layers.{layer}", "attn_out": f"layers.{layer}.self_attn", "mlp_out": f"layers.{layer}.mlp"}.get(
        site, f"{site}.{layer}")  # fmt: skip


def _canonical(site: str, layer: int) -> tuple[str, int]:
    return ("resid_post", layer - 1) if site == "resid_pre" and layer > 0 else (site, layer)  # the same activations


def same_site(a: tuple[str, int], b: tuple[str, int]) -> bool:
    """Whether two (site, layer) read the same activations (resid_pre L is resid_post L-1)."""
    return _canonical(*a) == _canonical(*b)


@dataclass(frozen=True)
class Sae:
    """An SAE's decoder, read a feature at a time (a 131k-feature SAE is gigabytes; a feature is one row):
    `shape` (d_sae, d_in), its b_dec ([d_in] or None), where it reads. `key` holds the decoder in `file`."""

    path: Path
    layout: str
    file: Path
    key: str
    shape: tuple[int, int]
    b_dec: np.ndarray | None
    hook_name: str | None
    head: int | None = None  # sae-lens `hook_head_index`: an SAE of one head's hook_z

    @property
    def width(self) -> int:
        return self.shape[1]

    @property
    def site(self) -> tuple[str, int] | None:
        return site_of(self.hook_name) if self.hook_name else None

    def _read(self, index):
        return read_part(self.file, self.key, index, columns=self.layout == "goodfire")  # Goodfire's is an nn.Linear: [d_in, d_sae]

    def feature(self, index: int) -> np.ndarray:
        """Feature `index`'s decoder direction, float32 [d_in], checked finite."""
        n = self.shape[0]
        if not 0 <= index < n:
            raise SaeError(f"{self.path}: feature {index} is past the SAE's {n} features (use 0..{n - 1})")
        try:
            row = np.ascontiguousarray(self._read(index), dtype=np.float32).reshape(-1)
        except Exception as e:  # safetensors' own errors (bfloat16 for numpy, a truncated file, ...)
            raise SaeError(f"{self.file}: cannot read {self.key} ({type(e).__name__}: {e}); save the SAE in float32") from None
        bad = int((~np.isfinite(row)).sum())
        if bad:
            raise SaeError(f"{self.path}: feature {index}'s decoder row holds {bad} NaN/inf value(s); this SAE file is damaged")
        return row

    def decoder(self) -> np.ndarray:
        """The whole decoder as [d_sae, d_in] float32 (every feature: for small SAEs and tests)."""
        whole = self._read(slice(None))
        return np.ascontiguousarray(whole.T if self.layout == "goodfire" else whole, dtype=np.float32)


def read_part(file: Path, key: str, index, columns: bool = False) -> np.ndarray:
    """`file[key][index]` (`[:, index]` with `columns`) as numpy reads it; bfloat16 (sae-lens saves SAEs so, numpy
    has no such type) widened to float32 exactly, from the file's bytes."""
    from safetensors import safe_open

    with safe_open(str(file), framework="np") as f:
        part = f.get_slice(key)
        if part.get_dtype() != "BF16":
            return part[:, index] if columns else part[index]
        shape = tuple(part.get_shape())
    raw = _bf16(file, key, shape)
    return (np.asarray(raw[:, index] if columns else raw[index], dtype=np.uint32) << 16).view(np.float32)


def _bf16(file: Path, key: str, shape: tuple) -> np.ndarray:
    """The bfloat16 tensor `key` as uint16 bits, mapped from the file (safetensors: an 8-byte little-endian header
    length, the JSON header with each tensor's data_offsets, then the data)."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        start, _ = json.loads(f.read(n))[key]["data_offsets"]
    return np.memmap(file, dtype="<u2", mode="r", offset=8 + n + start, shape=shape)


def _header(file: Path, key: str, bias: str) -> tuple[tuple, np.ndarray | None]:
    """((the decoder's shape, its dtype), b_dec) without reading the decoder."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="np") as f:
            names = set(f.keys())
            part = f.get_slice(key) if key in names else None
            found = (tuple(part.get_shape()), str(part.get_dtype())) if part is not None else (None, None)
        return found, (read_part(file, bias, slice(None)) if bias in names else None)
    except Exception as e:  # safetensors' own errors (bad header, bfloat16 for numpy, ...)
        raise SaeError(f"{file}: not a readable .safetensors file of float tensors ({type(e).__name__}: {e})") from None


def read_cfg(path: Path) -> dict:
    """An SAE's cfg.json as a dict; anything else is one SaeError line naming the file."""
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SaeError(f"{path}: not a readable JSON config ({type(e).__name__}: {e})") from None
    if not isinstance(cfg, dict):
        raise SaeError(f"{path}: must hold a JSON object")
    return cfg


def _checked(path: Path, layout: str, file: Path, hook: str | None, head: int | None = None) -> Sae:
    key, bias = ("decoder_linear.weight", "decoder_linear.bias") if layout == "goodfire" else ("W_dec", "b_dec")
    (shape, dtype), b = _header(file, key, bias)
    if shape is None:
        raise SaeError(f"{file}: no decoder weights (a {layout} SAE keeps them as {key}); was it saved without its decoder?")
    if len(shape) != 2 or not dtype.upper().startswith(("F", "BF")):
        raise SaeError(f"{file}: the decoder {key} is {dtype} of shape {list(shape)}, not a 2-D float matrix")
    shape = (shape[1], shape[0]) if layout == "goodfire" else (shape[0], shape[1])
    if b is not None:
        b = np.ascontiguousarray(b, dtype=np.float32).reshape(-1)
        if b.shape[0] != shape[1]:
            raise SaeError(f"{file}: {bias} has {b.shape[0]} values but the decoder writes {shape[1]}")
        if not np.isfinite(b).all():
            raise SaeError(f"{file}: {bias} holds {int((~np.isfinite(b)).sum())} NaN/inf value(s); this SAE file is damaged")
    return Sae(path, layout, file, key, shape, b, hook, head)


def _hook_name(cfg: dict) -> str | None:
    meta = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
    name = meta.get("hook_name") or cfg.get("hook_name")
    return name if isinstance(name, str) else None


def _head_index(cfg: dict) -> int | None:
    meta = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
    head = meta.get("hook_head_index", cfg.get("hook_head_index"))
    return head if isinstance(head, int) and not isinstance(head, bool) else None


def read_sae(path: str | Path, hookpoint: str | None = None) -> Sae:
    """The SAE at `path` (a folder, or a Goodfire .safetensors file); `hookpoint` picks one folder of a sparsify run."""
    path = Path(path).expanduser()
    if path.is_file() and path.suffix == ".safetensors":
        return _checked(path, "goodfire", path, None)
    if path.is_file() and path.suffix.lower() in (".pt", ".pth", ".bin", ".pkl"):
        raise SaeError(f"{path}: a pickle-based file, which Orchard never loads (unpickling can run code); "
                       "convert it with `driver steer convert` to .safetensors")  # fmt: skip
    if not path.is_dir():
        raise SaeError(f"{path}: no such SAE folder (Orchard reads SAEs from local folders: download it first)")
    if (path / "sae_weights.safetensors").is_file():
        if not (path / "cfg.json").is_file():  # it names the site the SAE reads and how it encodes: nothing to guess
            raise SaeError(f"{path}: no cfg.json beside sae_weights.safetensors (sae-lens saves one: the SAE's hook_name and "
                           "architecture); copy it from where the SAE came from")  # fmt: skip
        cfg = read_cfg(path / "cfg.json")
        return _checked(path, "sae_lens", path / "sae_weights.safetensors", _hook_name(cfg), _head_index(cfg))
    if (path / "sae.safetensors").is_file():
        return _checked(path, "sparsify", path / "sae.safetensors", path.name if site_of(path.name) else None)
    if hookpoint and (path / hookpoint).is_dir():
        return read_sae(path / hookpoint)
    goodfire = sorted(path.glob("*.safetensors"))
    if len(goodfire) == 1:
        return read_sae(goodfire[0])
    inside = sorted(p.name for p in path.iterdir() if p.is_dir() and (p / "sae.safetensors").is_file())
    if inside:
        want = f"no folder {hookpoint!r} for this site; " if hookpoint else ""
        raise SaeError(f"{path}: {want}a sparsify run with one SAE per hookpoint ({', '.join(inside[:8])}): name one")
    raise SaeError(f"{path}: not an SAE folder: expected cfg.json with sae_weights.safetensors (sae_lens) or "
                   "sae.safetensors (sparsify), or one .safetensors with decoder_linear.weight (Goodfire)")  # fmt: skip


# --- a feature as an intervention's vector ------------------------------------------------------------------


def _expected_sites(site: str, layer: int) -> list[tuple[str, int]]:
    """The SAE sites an intervention at (site, layer) can take a feature of: its own, and for one head lm-eval's
    `layers.L.self_attn` with head_index (the attention's output) as well as TransformerLens' `attn.hook_z`."""
    return [(site, layer), ("attn_out", layer)] if site == "attn_head" else [(site, layer)]


def site_problem(sae: Sae, site: str, layer: int | None) -> str | None:
    """Why `sae` cannot serve an intervention at (site, layer): it reads another site; None when it can (or cannot tell)."""
    if sae.site is None or layer is None or any(same_site(sae.site, s) for s in _expected_sites(site, layer)):
        return None
    return (f"the SAE at {sae.path} reads {sae.hook_name} ({sae.site[0]} at layer {sae.site[1]}), but the intervention "
            f"steers {site} at layer {layer}: use that SAE's site and layer, or the SAE of this one")


def feature_vector(ref, site: str, layer: int | None, base: Path, fail, head: int | None = None) -> tuple[np.ndarray, dict, float]:
    """(float32 vector, record entry, alpha shift) of `ref` = `{sae, feature, hookpoint, about_b_dec}` for an
    intervention at `site` and `layer` (resolved, or None when the model's layer count is unknown).

    The shift: lm-eval's clamp subtracts b_dec, sets the projection on u to alpha and adds b_dec back, which is
    Orchard's clamp to alpha + b_dec·u; `about_b_dec` asks for it."""
    path = Path(ref.sae).expanduser()
    path = path if path.is_absolute() else base / path
    hookpoint = ref.hookpoint or (hookpoint_name(site, layer) if layer is not None else None)
    try:
        sae = read_sae(path, hookpoint)
    except SaeError as e:
        raise fail(str(e), ".sae") from None
    try:
        vector = sae.feature(ref.feature)
    except SaeError as e:
        raise fail(str(e), ".feature") from None
    problem = site_problem(sae, site, layer)
    if problem:
        raise fail(problem, ".sae")
    if sae.head is not None and head is not None and sae.head != head:
        raise fail(f"the SAE at {sae.path} reads head {sae.head} (hook_head_index) but the intervention steers head {head}", ".sae")
    if not vector.any():
        raise fail(f"feature {ref.feature} of the SAE at {sae.path} has an all-zero decoder row: it has no direction", ".feature")
    shift = 0.0
    if ref.about_b_dec:
        if sae.b_dec is None:
            raise fail(f"the SAE at {sae.path} has no b_dec to clamp about: remove about_b_dec", ".about_b_dec")
        u = vector.astype(np.float64) / np.linalg.norm(vector.astype(np.float64))
        shift = float(sae.b_dec.astype(np.float64) @ u)
    record = {"path": str(sae.path), "key": f"feature {ref.feature}", "layout": sae.layout, "hook_name": sae.hook_name,
              "feature": ref.feature, "d_sae": sae.shape[0], "d_in": sae.width, "about_b_dec": ref.about_b_dec,
              "b_dec_projection": shift if ref.about_b_dec else None}  # fmt: skip
    return vector, record, shift
