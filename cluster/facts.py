"""What a node is: host, OS, chip, memory and the versions that decide its numbers."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
from importlib.metadata import PackageNotFoundError, version

PACKAGES = ("mlx", "mlx-lm", "lm_eval", "ray", "orchard")
# What every worker must share: a different mlx, mlx-lm, Orchard or model file can change a number; Ray refuses mixed
# Python or Ray versions anyway, but later and less clearly. `model_files` is reported by the worker actor.
MUST_MATCH = ("python", "mlx", "mlx-lm", "orchard", "ray", "model_files", "adapter_files")


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


def mlx_device() -> dict:
    """MLX's default device and the memory it recommends for models: Metal's recommended working set on macOS
    (`max_recommended_working_set_size`), the machine's memory where MLX runs on the CPU."""
    import mlx.core as mx

    kind = "gpu" if "gpu" in str(mx.default_device()).lower() else "cpu"
    info: dict = {}
    for source in (getattr(mx, "device_info", None), getattr(getattr(mx, "metal", None), "device_info", None)):
        try:  # mx.device_info() since mlx 0.29ish, mx.metal.device_info() before; either may raise without Metal
            info = dict(source()) if source else {}
        except Exception:
            info = {}
        if info:
            break
    name = info.get("device_name") or info.get("architecture")
    working_set = info.get("max_recommended_working_set_size")
    memory = _memory_gb() if not working_set else round(working_set / 2**30, 1)
    return {"mlx_device": kind, "mlx_device_name": name, "model_memory_gb": memory,
            "model_memory_source": "Metal recommended working set" if working_set else "system memory"}  # fmt: skip


def _memory_gb() -> float:
    return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)


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
        "memory_gb": _memory_gb(),
        **mlx_device(),
        "python": platform.python_version(),
        "blas": blas(),
        **{p: _version(p) for p in PACKAGES},
    }


def mismatch(facts: list[dict], who: str = "workers") -> str | None:
    """A one-line description of the first version `who` (workers, nodes) disagree on, or None when they all agree."""
    hosts = [f.get("hostname") or "?" for f in facts]
    unique = len(set(hosts)) == len(hosts)  # several nodes on one machine: tell them apart by node id
    for key in MUST_MATCH:
        values: dict[str, list[str]] = {}
        for f, host in zip(facts, hosts):
            v = f.get(key) or "missing"
            if key == "python":  # the patch level does not matter
                v = ".".join(v.split(".")[:2])
            values.setdefault(v, []).append(host if unique else f"{host} (node {str(f.get('node_id'))[:8]})")
        if len(values) > 1:
            where = "; ".join(f"{v} on {', '.join(sorted(set(hosts)))}" for v, hosts in sorted(values.items()))
            files = {"model_files": "model files", "adapter_files": "adapter files"}
            fix = f"give every Mac the same {files[key]}" if key in files else f"install the same {key} on every Mac"
            return f"{who} disagree on {key} ({where}): {fix}"
    return None


def node_rows(table: list[dict], facts: list[dict]) -> list[dict]:
    """One row per node of `ray.nodes()` (`table`): its facts where it is an alive `mlx` node (`facts`, from
    `node_facts()`), else what Ray knows; with its `mlx` units and whether it is alive."""
    by_id = {f["node_id"]: f for f in facts}
    rows = []
    for n in table:
        known = by_id.get(n["NodeID"]) or {"hostname": n.get("NodeManagerHostname")}
        units = n.get("Resources", {}).get("mlx", 0)
        rows.append({**known, "node_id": n["NodeID"], "address": n.get("NodeManagerAddress"),
                     "mlx_units": int(units) if float(units).is_integer() else units, "alive": bool(n.get("Alive"))})  # fmt: skip
    return rows


def node_line(row: dict) -> str:
    """A row as one line of `driver nodes`."""
    get = lambda key: row.get(key) or "-"  # noqa: E731
    device = f"{get('mlx_device')} ({get('mlx_device_name')})" if row.get("mlx_device") else "-"
    memory = f"{row['model_memory_gb']} GB for models ({row['model_memory_source']})" if row.get("model_memory_gb") else "-"
    versions = "  ".join(f"{name} {get(key)}" for name, key in VERSION_COLUMNS)
    return (
        f"{get('hostname'):<16} {row['node_id'][:12]}  {get('os')} {get('arch')}  chip {get('chip')}  "
        f"{get('memory_gb')} GB  MLX {device}, {memory}  BLAS {get('blas')}  {versions}  "
        f"mlx units {row.get('mlx_units', 0)}  {'alive' if row.get('alive') else 'DEAD'}"
    )


VERSION_COLUMNS = (("python", "python"), ("mlx", "mlx"), ("mlx-lm", "mlx-lm"), ("lm-eval", "lm_eval"), ("ray", "ray"), ("orchard", "orchard"))
