"""What a split needs before anything loads: each rank's layers, and whether a model can be split so (pure)."""

from __future__ import annotations

import ast
import importlib.util
import math
import re
import sys
from functools import lru_cache
from pathlib import Path


SPLITS = ("pipeline", "tensor")
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads")
_KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
_INTER_KEYS = ("intermediate_size", "n_inner", "ffn_dim")


def config_int(config: dict, keys: tuple[str, ...]) -> int | None:
    """The first positive integer under one of `keys`, in the config or its `text_config` (multimodal models)."""
    for source in (config, config.get("text_config") or {}):
        for key in keys:
            value = source.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def layer_ranges(n_layers: int, size: int, head: float = 0.0, embed: float = 0.0) -> list[tuple[int, int]]:
    """Contiguous [start, end) per rank, rank 0 the first layers, at least one each: the split whose busiest rank
    costs least, counting `embed` layers' worth of work on rank 0 and `head` on the last (the vocabulary head);
    among equal ones the low ranks take the extra layers."""
    cost = lambda r, a, b: b - a + (embed if r == 0 else 0.0) + (head if r == size - 1 else 0.0)  # noqa: E731
    best: dict = {}  # (rank, start) -> (max cost of ranks rank.., their ends)

    def plan(rank: int, start: int) -> tuple:
        if rank == size - 1:
            return cost(rank, start, n_layers), (n_layers,)
        if (rank, start) not in best:
            options = [(max(cost(rank, start, end), plan(rank + 1, end)[0]), -end, end) for end in range(start + 1, n_layers - size + rank + 2)]
            top, _, end = min(options)
            best[rank, start] = top, (end, *plan(rank + 1, end)[1])
        return best[rank, start]

    ends = plan(0, 0)[1] if n_layers >= size else tuple(min(n_layers, r + 1) for r in range(size))
    return list(zip((0, *ends[:-1]), ends))


def head_layers(config: dict) -> float:
    """What the vocabulary head (final norm, lm head, log-softmax) costs in decoder layers at a position it runs
    on: its matmul weights over one layer's (q, k, v, o and a gated MLP's three); 0 where the config does not
    say. The embedding is a row lookup: no matmul, counted as 0 (an estimate, not measured)."""
    hidden, vocab = config_int(config, _HIDDEN_KEYS), config_int(config, ("vocab_size",))
    if not (hidden and vocab):
        return 0.0
    heads = config_int(config, _HEAD_KEYS)
    kv_share = (config_int(config, _KV_HEAD_KEYS) or heads) / heads if heads else 1.0
    inter = config_int(config, _INTER_KEYS) or 4 * hidden
    return vocab * hidden / (hidden * hidden * (2 + 2 * kv_share) + 3 * hidden * inter)


def pipeline_ranges(config: dict, size: int) -> list[tuple[int, int]]:
    """Each rank's layers for `config`'s model: balanced with the head on the last rank at its decode cost (a
    generated token runs it once per row; scoring only at the scored positions, where it costs next to nothing)."""
    return layer_ranges(config_int(config, LAYER_KEYS) or 0, size, head=head_layers(config))


def answering_rank(grouping) -> int:
    """The rank whose results are its group's: the last under pipeline (pipelined kernels compute the numbers
    there only; lockstep ones on every rank), rank 0 otherwise."""
    return grouping.size - 1 if grouping is not None and grouping.split == "pipeline" else 0


def _models_folder() -> Path | None:
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


@lru_cache(maxsize=1)
def _remapping() -> dict:
    """mlx-lm's MODEL_REMAPPING (e.g. mistral -> llama), read from its source: no MLX import."""
    folder = _models_folder()
    if folder is None or "mlx_lm.utils" in sys.modules:
        return dict(getattr(sys.modules.get("mlx_lm.utils"), "MODEL_REMAPPING", {}))
    for node in ast.parse((folder / "utils.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "MODEL_REMAPPING" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def has_shard(model_type: str) -> bool:
    """Whether mlx-lm's module for this family defines `shard` (tensor parallelism), read from its source."""
    folder = _models_folder()
    module = _remapping().get(model_type, model_type)
    if folder is None or not re.fullmatch(r"\w+", module or ""):
        return False
    source = folder / "models" / f"{module}.py"
    return source.is_file() and re.search(r"^\s+def shard\(", source.read_text(), re.M) is not None


def check(config: dict, size: int, split: str) -> str | None:
    """One line naming why `config`'s model cannot be split `split` over `size` ranks, and the fix; None if it can."""
    if split not in SPLITS:
        return f"unknown split {split!r}: choose pipeline or tensor"
    if size < 1:
        return f"group size {size} is below 1: give a group size of 1 or more"
    if size == 1:
        return None
    return _check_pipeline(config, size) if split == "pipeline" else _check_tensor(config, size)


def _check_pipeline(config: dict, size: int) -> str | None:
    layers = config_int(config, LAYER_KEYS)
    if layers is not None and size > layers:
        return (f"group size {size} is larger than the model's {layers} layers: a pipeline needs a layer per rank: "
                f"use a group size of at most {layers}")  # fmt: skip
    return None


def _check_tensor(config: dict, size: int) -> str | None:
    family = str(config.get("model_type", "model"))
    if not has_shard(family):
        return f"mlx-lm has no tensor split (shard) for {family} models: use --split pipeline"
    heads = config_int(config, _HEAD_KEYS)
    kv_heads = config_int(config, _KV_HEAD_KEYS) or heads
    for what, n in (("attention heads", heads), ("key/value heads", kv_heads)):
        if n is not None and n % size:
            return (f"the model's {n} {what} do not divide by group size {size}: use a group size that divides "
                    f"{n}, or --split pipeline")  # fmt: skip
    return None


def smallest_size(need_gb: float, have_gb: float) -> int:
    """The fewest ranks of `have_gb` each for models whose shares hold `need_gb` of weights (0: none will)."""
    return max(1, math.ceil(need_gb / have_gb)) if have_gb > 0 else 0


def peak_memory_gb() -> float:
    """This process's peak memory in GB: MLX's own peak (its arrays), else the peak resident set size."""
    try:
        import mlx.core as mx

        peak = mx.get_peak_memory()
        if peak > 0:
            return peak / 1e9
    except (ImportError, AttributeError, RuntimeError):
        pass
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1e9 if sys.platform == "darwin" else rss * 1024 / 1e9
