"""What a node is: host, OS, chip, memory and the versions that decide its numbers."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from importlib.metadata import PackageNotFoundError, version

PACKAGES = ("mlx", "mlx-lm", "lm_eval", "ray")
# What every worker must share: a different mlx, mlx-lm or model file can change a number; Ray refuses mixed
# Python or Ray versions anyway, but later and less clearly. `model_files` is reported by the worker actor.
MUST_MATCH = ("python", "mlx", "mlx-lm", "ray", "model_files")


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _chip() -> str | None:
    if platform.system() != "Darwin":
        return None
    try:
        out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# Debian/Ubuntu's `libopenblas0-pthread`: preloaded into a Linux worker, MLX's CPU matmuls run ~10x faster
# than on the reference BLAS that mlx[cpu] wheels bundle (same numbers within float32 rounding).
OPENBLAS = tuple(f"/usr/lib/{arch}-linux-gnu/openblas-pthread/libopenblas.so.0" for arch in ("x86_64", "aarch64"))
BLAS_HINT = "install Debian's libopenblas0-pthread on it (apt-get install libopenblas0-pthread): ~10x faster on Linux"


def fast_blas() -> str | None:
    """A fast BLAS to preload into Linux workers (ORCHARD_BLAS: a path, or `reference` for none); None on macOS."""
    choice = os.environ.get("ORCHARD_BLAS", "")
    if platform.system() != "Linux" or choice == "reference":
        return None
    if choice:
        return choice
    return next((p for p in OPENBLAS if os.path.exists(p)), None)


def blas() -> str:
    """Which BLAS this process runs MLX's CPU matmuls with (OpenBLAS when preloaded on Linux: ~10x the bundled one)."""
    if platform.system() == "Darwin":
        return "Accelerate (macOS)"
    import mlx.core  # noqa: F401  (loading mlx maps its BLAS)

    try:
        with open("/proc/self/maps") as maps:
            libs = {line.split()[-1] for line in maps if ".so" in line}
    except OSError:
        return "unknown"
    names = sorted(os.path.basename(p) for p in libs)
    # numpy's own `libscipy_openblas` serves numpy only; a preloaded libopenblas serves MLX's BLAS symbols.
    if any(n.startswith("libopenblas") for n in names):
        return "OpenBLAS (preloaded)"
    bundled = [n for n in names if n.startswith("libblas")]
    return f"reference BLAS bundled with mlx ({bundled[0]})" if bundled else "unknown"


def slow_blas(facts: list[dict]) -> str | None:
    """One warning line when a Linux worker runs MLX on the reference BLAS, else None."""
    slow = sorted({f.get("hostname") or "?" for f in facts if str(f.get("blas", "")).startswith("reference")})
    if not slow:
        return None
    return f"warning: {', '.join(slow)} run{'s' * (len(slow) == 1)} MLX on the reference BLAS: {BLAS_HINT}"


def collect() -> dict:
    """Facts about the machine this runs on (inside an actor: the node it was placed on)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    return {
        "node_id": node_id,
        "hostname": socket.gethostname(),
        "os": f"{platform.system()} {platform.release()}",
        "arch": platform.machine(),
        "chip": _chip(),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "blas": blas(),
        **{p: _version(p) for p in PACKAGES},
    }


def mismatch(facts: list[dict]) -> str | None:
    """A one-line description of the first version workers disagree on, or None when they all agree."""
    for key in MUST_MATCH:
        values: dict[str, list[str]] = {}
        for f in facts:
            v = f.get(key) or "missing"
            if key == "python":  # the patch level does not matter
                v = ".".join(v.split(".")[:2])
            values.setdefault(v, []).append(f.get("hostname") or "?")
        if len(values) > 1:
            where = "; ".join(f"{v} on {', '.join(sorted(set(hosts)))}" for v, hosts in sorted(values.items()))
            fix = "give every Mac the same model files" if key == "model_files" else f"install the same {key} on every Mac"
            return f"workers disagree on {key} ({where}): {fix}"
    return None
