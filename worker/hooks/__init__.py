"""Hook points of mlx-lm decoder blocks: the residual stream `resid_pre.{L}`, `resid_mid.{L}`, `resid_post.{L}`,
the branch outputs `attn_out.{L}`, `mlp_out.{L}` (what each branch adds to the residual stream) and the heads'
outputs `attn_head.{L}` (the input of the attention's output projection, [batch, seq, heads*head_dim]).

`instrument(model)` swaps each decoder block's class for a subclass whose `__call__` runs the hooks around
the original one. The block stays the same object, so attribute reads (`use_sliding`, ...), any call
signature and the parameter tree (weight names, LoRA, quantization) are untouched. With nothing registered
the block's own output array is returned as is: the instrumented model is bitwise the plain model.
Branch points swap the class of the module whose output the block adds to the residual (the attention / MLP
module, or the post-branch norm in families that have one, e.g. gemma2/3, olmo2); `resid_mid` is edited
through the attention branch: the branch returns edited(x + attn_out) - x, which the block adds back to x.
Which hook points a model lacks is known per layer (`HookManager.missing`; hybrids hold attention on some
layers only), and `skeleton.missing_sites(config)` reads it off the blocks built without weights, before any
worker loads the model.

Modules: `manager` (the registry, Rows), `branches` (where a block's branches are), `instrument` (the class
swaps), `records` (Capture), `skeleton` (the driver's check), `blocks` (a span of blocks run alone: worker.grid,
conditional prefixes), `condition` and `condition_share` (conditional steering, its shared prefixes).

Kernels describe the rows of each forward with a `Rows` (where each row's real tokens, and its prompt,
begin and end in the padded layout); interventions turn it into position masks, so "last" is each row's
own last real token and pad positions are never changed. This module is the mechanism (hook points, Rows,
Capture); the steering ops live in `worker.steer`.
"""

from .instrument import architecture, decoder_layers, instrument
from .manager import HOOK_POINTS, POSITIONS, Hook, HookContext, HookError, HookManager, Rows
from .records import Capture

__all__ = ["HOOK_POINTS", "POSITIONS", "Capture", "Hook", "HookContext", "HookError", "HookManager", "Rows",
           "architecture", "decoder_layers", "instrument"]
