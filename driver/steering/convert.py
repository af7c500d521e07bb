"""lm-eval's `steered` .pt files -> an Orchard spec (steer.yaml) and its vectors (vectors.safetensors).

Orchard never unpickles a steering file at run time; this converter, run on the user's request, reads the .pt
with `torch.load(weights_only=True)` (tensors, dicts, numbers and strings only: no code runs) and writes files
Orchard reads without pickle. torch is needed for this command only.

Each entry `{hookpoint: {steering_vector, steering_coefficient, action, bias, head_index}}` becomes one
intervention, read as lm-eval's steered model applies it (the hookpoints as in `driver.steering.lmeval_csv`):
add is `coefficient * steering_vector`; clamp with a bias is the clamp about it, Orchard's clamp to
`coefficient + bias·u`; head_index at `layers.L.self_attn` steers head L.h (attn_head).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from worker.spec import SteeringError

from driver.steering.saes import HOOKPOINTS, site_of

__all__ = ["convert_pt"]


def _load_pt(path: Path) -> dict:
    try:
        import torch
    except ImportError:
        raise SteeringError(f"{path}: reading a .pt file needs torch (pip install torch), for this conversion only") from None
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise SteeringError(f"{path}: no such file") from None
    except Exception as e:  # weights_only refuses anything but tensors and plain containers
        raise SteeringError(" ".join(f"{path}: not a plain steering file of tensors ({type(e).__name__}: {e})".split()[:40])) from None
    if not isinstance(data, dict) or not data:
        raise SteeringError(f"{path}: expected lm-eval's {{hookpoint: {{steering_vector, action, ...}}}} dict")
    return data


def _array(value, path: Path, name: str) -> np.ndarray | None:
    if value is None:
        return None
    array = np.asarray(value.detach().cpu().float().numpy() if hasattr(value, "detach") else value, dtype=np.float32).reshape(-1)
    if not np.isfinite(array).all():
        raise SteeringError(f"{path}: {name} holds NaN/inf values")
    return array


def _intervention(path: Path, hookpoint: str, info: dict) -> tuple[dict, str, np.ndarray]:
    """(intervention, its vector's key, the vector) of one entry."""
    at = site_of(str(hookpoint))
    if at is None:
        raise SteeringError(f"{path}: hookpoint {hookpoint!r} is not one Orchard knows (use {HOOKPOINTS})")
    if not isinstance(info, dict) or "steering_vector" not in info:
        raise SteeringError(f"{path}: {hookpoint}: expected a dict with steering_vector")
    (site, layer), action = at, info.get("action", "add")
    if action not in ("add", "clamp"):
        raise SteeringError(f"{path}: {hookpoint}: action {action!r} is not lm-eval's add or clamp")
    v = _array(info["steering_vector"], path, f"{hookpoint}.steering_vector")
    bias = _array(info.get("bias"), path, f"{hookpoint}.bias")
    alpha = float(info.get("steering_coefficient", 1.0))
    if action == "add" and bias is not None:
        raise SteeringError(f"{path}: {hookpoint}: add with a bias (lm-eval refuses it too): drop the bias")
    if action == "clamp" and bias is not None:
        u = v.astype(np.float64) / np.linalg.norm(v.astype(np.float64))
        alpha += float(bias.astype(np.float64) @ u)
    head = info.get("head_index")
    iv = {"layer": layer, "site": site, "op": action, "alpha": alpha}
    if head is not None:
        if site != "attn_out":
            raise SteeringError(f"{path}: {hookpoint}: head_index applies to layers.L.self_attn")
        iv.update(site="attn_head", head=int(head))
    key = f"{iv['site']}.{layer}" + (f".{int(head)}" if head is not None else "")
    return {**iv, "vector": {"file": "vectors.safetensors", "key": key}}, key, v


def convert_pt(source: str | Path, out: str | Path) -> tuple[Path, Path]:
    """Write `out`/steer.yaml and `out`/vectors.safetensors from lm-eval's .pt; returns their paths."""
    import yaml

    from driver.steering.vectors import write_vectors

    source, out = Path(source).expanduser(), Path(out).expanduser()
    data = _load_pt(source)
    interventions, vectors = [], {}
    for hookpoint, info in data.items():
        iv, key, v = _intervention(source, hookpoint, info)
        if key in vectors:
            raise SteeringError(f"{source}: two entries steer {key}: keep one")
        interventions.append(iv)
        vectors[key] = v
    out.mkdir(parents=True, exist_ok=True)
    tensors = write_vectors(out / "vectors.safetensors", vectors, {"converted_from": str(source.absolute())})
    spec = out / "steer.yaml"
    spec.write_text(f"# converted from {source} (lm-eval steered .pt) by `driver steer convert`\n"
                    + yaml.safe_dump({"interventions": interventions}, sort_keys=False))  # fmt: skip
    return spec, tensors
