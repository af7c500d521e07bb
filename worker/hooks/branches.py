"""Where each branch of one decoder block is: the module whose output the block adds to its residual stream for
`attn_out` and `mlp_out`, the attention's output projection for `attn_head`, or why the block has none.

`attn_out` is the block's softmax-attention branch (self-attention, local/sliding attention, MLA): what
TransformerLens's `hook_attn_out` and pyvene's `attention_output` name. A hybrid's other token mixers (linear
attention, Mamba, short convolutions, RG-LRU) are not attention: their state, width and heads differ, so a
vector captured there is not an attention vector. At those layers the site is refused, naming the layers that
have an attention branch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.nn as nn

# What families name the attention branch, most specific first (dbrx nests it in `norm_attn_norm`; exaone's block
# calls `attn.attention`). `mixer` / `temporal_block` hold attention on some layers only: their class says which.
ATTENTION_PATHS = ("norm_attn_norm.attn", "attn.attention", "self_attn", "attn", "attention", "self_attention",
                   "mixer", "temporal_block")  # fmt: skip
MIXER_SLOTS = ("mixer", "temporal_block")
MLP_PATHS = ("mlp", "feed_forward", "block_sparse_moe", "moe", "ffn", "mlp_block", "mixer")
# Token mixers that are not attention, named in a refusal.
OTHER_MIXERS = ("linear_attn", "mamba", "conv", "mixer", "temporal_block")
# The modules whose outputs are what the block adds, after a branch: post-branch norms (gemma2/3, olmo2, glm4,
# afmoe, plamo) and learned gains (talkie). The attention's is looked up only where the MLP's exists
# (glm4's `post_attention_layernorm` is its pre-MLP norm: it has `post_self_attn_layernorm`).
POST_MLP = ("post_feedforward_layernorm", "post_mlp_layernorm", "post_mlp_norm", "mlp_gain")
POST_ATTENTION = ("post_self_attn_layernorm", "post_mixer_norm", "attn_gain", "post_attention_layernorm")
# What the attention module names its output projection, whose input is the heads' outputs side by side.
OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "dense", "c_proj", "wo", "attn_resid")
# A second MLP beside the block's MLP, summed with it before the add: no one module outputs the branch.
SIBLING_MLPS = ("shared_mlp",)


@dataclass
class Branches:
    """One block's branch modules (None where absent) and, for each absent one, what the block has instead."""

    attn: Any = None
    mlp: Any = None
    projection: Any = None
    scale: float | None = None  # the factor the block multiplies both branches by before adding (granite, minicpm)
    why: dict[str, str] | None = None  # site -> what this block has instead ("linear attention (linear_attn)")


def _get(block, path: str):
    """The module at a dotted attribute path, None if there is none (a function or a list is no branch)."""
    for name in path.split("."):
        block = getattr(block, name, None)
    return block if isinstance(block, nn.Module) else None


def _kind(module) -> str:
    """'attention', 'mlp' or 'other' (Mamba, convolution, RG-LRU, linear attention), by the module's class name."""
    name = type(module).__name__.lower()
    if any(word in name for word in ("mamba", "conv", "recurrent", "delta", "linear")):
        return "other"
    if "attention" in name:
        return "attention"
    return "mlp" if ("mlp" in name or "moe" in name) else "other"


def _branch(block, paths, kind: str):
    """The first module at `paths`; one in a shared mixer slot only if its class says it is of `kind`."""
    for path in paths:
        found = _get(block, path)
        if found is not None and (path not in MIXER_SLOTS or _kind(found) == kind):
            return found
    return None


def _first(block, names):
    return next((found for n in names if (found := _get(block, n)) is not None), None)


def _mixer(block) -> str | None:
    """The block's token mixer that is not attention, as '<Class> (<attribute>)'; None if it has none."""
    for name in OTHER_MIXERS:
        found = _get(block, name)
        if found is not None and _kind(found) == "other":
            return f"{type(found).__name__} ({name})"
    return None


def scale(block) -> float | None:
    """The number the block multiplies each branch's output by before adding it (computed as its __call__ does)."""
    multiplier = getattr(block, "residual_multiplier", None)
    if isinstance(multiplier, (int, float)):
        return multiplier
    depth, layers = getattr(block, "scale_depth", None), getattr(block, "num_hidden_layers", None)
    if isinstance(depth, (int, float)) and isinstance(layers, int):  # minicpm
        return depth / layers**0.5
    return None


def branches(block) -> Branches:
    """Where `block`'s attention and MLP branches are, as the block adds them; why each missing one is missing."""
    why: dict[str, str] = {}
    if any(isinstance(getattr(block, n, None), list) for n in ("self_attn", "attn")):  # longcat_flash
        why["attn_out"] = why["mlp_out"] = ("it runs two attention sublayers, each with its own MLP, and a shortcut "
                                            "MoE: no one module is its attention or MLP branch")  # fmt: skip
        return Branches(why=why)
    attn, mlp = _branch(block, ATTENTION_PATHS, "attention"), _branch(block, MLP_PATHS, "mlp")
    if attn is None:
        mixer = _mixer(block)
        why["attn_out"] = f"its token mixer is {mixer}, not attention" if mixer else "it has no attention module"
    if mlp is not None and any(_get(block, n) is not None for n in SIBLING_MLPS):
        why["mlp_out"] = f"its MLP branch is the sum of two modules' outputs (the MLP and {' / '.join(SIBLING_MLPS)}), no one module's"
        mlp = None
    elif mlp is None:
        why["mlp_out"] = "it has no MLP module"
    projection = _first(attn, OUTPUT_PROJECTIONS) if attn is not None else None
    if attn is not None and projection is None:
        why["attn_head"] = f"its attention has no output projection ({' / '.join(OUTPUT_PROJECTIONS)}) whose input is the heads' outputs"
    post_mlp = _first(block, POST_MLP)
    if post_mlp is not None:
        post_attn = _first(block, POST_ATTENTION)
        mlp = post_mlp if mlp is not None else None
        attn = post_attn if attn is not None and post_attn is not None else attn
    if attn is not None and _mixer(block):  # falcon_h1: a Mamba branch added beside attention
        why["resid_mid"] = f"a second token mixer, {_mixer(block)}, is added beside its attention: steer attn_out or mlp_out"
    return Branches(attn, mlp, projection, scale(block), why)
