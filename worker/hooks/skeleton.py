"""The sites a model lacks, known before any worker loads it: build the model's module tree from its config.json
with mlx-lm's own classes, without weights, instrument it with the worker's code and read `HookManager.missing`.

Nothing is evaluated: MLX is lazy, so the parameters are unevaluated random arrays (a graph node each, no
memory); an 80-layer, 8192-wide llama builds in well under a second (bench/README.md). Quantization is
ignored (it does not change which modules a block holds). Where the skeleton cannot be built (a family this
mlx-lm does not know, a config its ModelArgs refuses, no MLX here) the config rules answer
(`worker.spec.missing_sites`), and the worker's hooks refuse the rest when the job installs them.
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

from ..spec import missing_sites as config_rules


def skeleton(config: dict) -> Any:
    """The model of `config.json` built by mlx-lm's classes, weights unevaluated (never mx.eval'd)."""
    from mlx_lm.utils import _get_classes

    config = copy.deepcopy(config)  # the __post_init__ of some families' ModelArgs edit what they are given
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    model_class, args_class = _get_classes(config)
    return model_class(args_class.from_dict(config))


def missing_sites(config: dict) -> dict[str, str]:
    """{site or "site.L": why} for the hook points this model's blocks lack, exactly as its worker's hooks will say
    (`worker.spec.site_missing` reads it); the config rules where the blocks cannot be built here."""
    return dict(_missing(json.dumps(config, sort_keys=True, default=str)))


@functools.lru_cache(maxsize=8)  # a sweep checks every configuration against the same config.json
def _missing(text: str) -> dict[str, str]:
    from .instrument import instrument

    config = json.loads(text)
    rules = config_rules(config)
    try:
        hooks = instrument(skeleton(config))
    except Exception:  # noqa: BLE001 - any family mlx-lm cannot build from this config alone: the rules answer
        return rules
    return {**rules, **hooks.missing}
