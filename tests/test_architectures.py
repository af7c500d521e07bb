"""Every architecture family the testbed writes: instrumenting is a bitwise no-op, hooks see and edit the real
residual stream between blocks, and a hook that cannot run is an error, never a silent no-op."""

from __future__ import annotations

import contextlib

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load as mlx_load

from testbed.models import ARCHITECTURES, write_model
from worker.hooks import Capture, HookError, Rows, decoder_layers
from worker.load import load
from worker.score import loglikelihood
from worker.spec import Intervention, Steering
from worker.steer import steered

LAYERS, MIDDLE, ALPHA = 3, 1, 2.0
TOKENS = [[1, 17, 33, 250, 9, 71, 400, 12], [1, 5, 6, 7, 8, 10, 11, 13]]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def models(request, tmp_path_factory):
    """(arch, instrumented LoadedModel, plain mlx-lm model) on the same random weights."""
    arch = request.param
    path = write_model(tmp_path_factory.mktemp("archs") / arch, arch=arch, layers=LAYERS)
    plain, _ = mlx_load(str(path))
    return arch, load(str(path)), plain


class AtBlock:
    """Stands in for a block of the plain model: runs it, then `after(input, output)` returns the output.

    Attribute reads go to the block (llama reads `use_sliding` off each layer in its forward).
    """

    def __init__(self, block, after):
        self.block, self.after = block, after

    def __getattr__(self, name):
        return getattr(self.block, name)

    def __call__(self, x, *args, **kwargs):
        return self.after(x, self.block(x, *args, **kwargs))


def forward_list(model) -> list:
    # The list the inner model's forward iterates (`model.layers` may be a copy: qwen2's pipeline slice).
    inner = model.model
    return inner.layers if hasattr(inner, "layers") else inner.h


@contextlib.contextmanager
def swapped(model, layer: int, stand_in):
    """Put `stand_in` in place of block `layer` in the list the model's forward iterates; restore it after."""
    layers = forward_list(model)
    block = layers[layer]
    layers[layer] = stand_in(block)
    try:
        yield
    finally:
        layers[layer] = block


def vector(lm, seed=0):
    d = lm.config.get("hidden_size") or lm.config["n_embd"]
    return np.random.default_rng(seed).standard_normal(d).astype(np.float32)


def add(layer, v, site="resid_post"):
    return Steering(interventions=(Intervention(layer=layer, site=site, vector=tuple(map(float, v)), alpha=ALPHA),))


def run(lm, steering=None):
    with steered(lm, steering), lm.hooks.forward(Rows()):
        return lm.model(mx.array(TOKENS))


def test_instrumented_model_is_bitwise_the_plain_model(models):
    arch, lm, plain = models
    x = mx.array(TOKENS)
    assert mx.array_equal(lm.model(x), plain(x)).item()
    assert lm.n_layers == LAYERS and lm.hooks.arch == arch
    assert type(decoder_layers(lm.model)[0]).__mro__[1] is type(decoder_layers(plain)[0])


def test_add_at_a_middle_layer_equals_adding_by_hand(models):
    arch, lm, plain = models
    v = vector(lm)
    steered_logits = run(lm, add(MIDDLE, v))
    # By hand: the plain (never instrumented) model with block MIDDLE's output shifted by alpha * v.
    with swapped(plain, MIDDLE, lambda b: AtBlock(b, lambda x, out: out + ALPHA * mx.array(v))):
        manual = plain(mx.array(TOKENS))
    assert mx.allclose(steered_logits, manual, atol=1e-5).item(), arch
    assert not mx.allclose(steered_logits, plain(mx.array(TOKENS)), atol=1e-2).item(), arch
    # The same residual point, named three ways: after block L, before block L+1, L counted from the end.
    assert mx.array_equal(run(lm, add(MIDDLE + 1, v, "resid_pre")), steered_logits).item()
    assert mx.array_equal(run(lm, add(MIDDLE - LAYERS, v)), steered_logits).item()


def test_capture_sees_the_blocks_input_and_output(models):
    arch, lm, plain = models
    seen = []
    with swapped(plain, MIDDLE, lambda b: AtBlock(b, lambda x, out: seen.append((x, out)) or out)):
        plain(mx.array(TOKENS))
    (x_by_hand, out_by_hand), = seen
    pre, post = Capture("all"), Capture("all")
    with lm.hooks.installed([(f"resid_pre.{MIDDLE}", pre), (f"resid_post.{MIDDLE}", post)]), lm.hooks.forward(Rows()):
        lm.model(mx.array(TOKENS))
    for b in range(len(TOKENS)):
        assert mx.array_equal(pre.records[0][b], x_by_hand[b]).item(), arch
        assert mx.array_equal(post.records[0][b], out_by_hand[b]).item(), arch


# --- a hook that cannot run -------------------------------------------------------------------------


class Unrolled:
    """A block whose model runs its parts directly instead of calling it, as some architectures do."""

    def __init__(self, block):
        self.block = block

    def __getattr__(self, name):
        return getattr(self.block, name)

    def __call__(self, x, mask=None, cache=None):
        b = self.block
        h = x + b.self_attn(b.input_layernorm(x), mask, cache)
        return h + b.mlp(b.post_attention_layernorm(h))


REQUESTS = [([1, 17, 33, 250], [9, 71]), ([1, 5, 6], [7, 8, 10])]


@pytest.mark.parametrize("how", ["bypassed", "never reached"])
def test_installed_hook_that_never_ran_is_an_error(llama_path, how):
    lm = load(str(llama_path))
    layers = forward_list(lm.model)
    if how == "bypassed":
        layers[1] = Unrolled(layers[1])
    else:  # the forward stops before the last block
        del layers[-1]
    v = vector(lm)
    with pytest.raises(HookError) as e:
        with steered(lm, add(1, v)):
            loglikelihood(lm, REQUESTS)
    msg = str(e.value)
    assert "resid_post.1" in msg and "llama" in msg and "\n" not in msg
    assert not lm.hooks.active  # removed all the same
    with steered(lm, add(0, v)):  # a block that does run: no error
        loglikelihood(lm, REQUESTS)
    with steered(lm, add(1, v)):  # no forward ran: nothing to report
        loglikelihood(lm, [])
    with pytest.raises(KeyError):  # the job's own error is what surfaces
        with steered(lm, add(1, v)):
            loglikelihood(lm, REQUESTS)
            raise KeyError("job failed")


def test_residual_stream_that_is_not_batch_seq_hidden_is_refused(llama_path):
    lm = load(str(llama_path))
    d = len(vector(lm))
    block = decoder_layers(lm.model)[0]
    with pytest.raises(HookError, match=r"resid_pre\.0: the llama model's residual stream has shape \(5, 64\)") as e:
        with lm.hooks.installed([("resid_pre.0", Capture("last"))]):
            block(mx.zeros((5, d)))  # e.g. an architecture that flattens [batch * seq, hidden]
    assert "\n" not in str(e.value)
