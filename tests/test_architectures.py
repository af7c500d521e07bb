"""Every architecture family the testbed writes: instrumenting is a bitwise no-op, hooks see and edit the real
residual stream between blocks, and a hook that cannot run is an error, never a silent no-op."""

from __future__ import annotations

import contextlib
import os

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load as mlx_load

from testbed.models import ARCHITECTURES, write_model
from worker.hooks import Capture, HookError, Rows, decoder_layers, instrument
from worker.load import load
from worker.score import loglikelihood
from worker.spec import Intervention, Steering
from worker.steer import steered

LAYERS, MIDDLE, ALPHA = 3, 1, 2.0
# every id is below the smallest vocabulary here (coverage_sites' 256): MLX reads past an embedding table without an
# error, so an id out of range gave random logits that differed run to run (seen as "not repeatable" families)
TOKENS = [[1, 17, 33, 250, 9, 71, 200, 12], [1, 5, 6, 7, 8, 10, 11, 13]]


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


@pytest.mark.parametrize("site", ["attn_out", "resid_mid", "mlp_out"])
def test_a_branch_hook_that_never_ran_is_an_error(llama_path, site):
    lm = load(str(llama_path))
    del forward_list(lm.model)[-1]  # the forward stops before the last block
    last = lm.n_layers - 1
    with pytest.raises(HookError, match=rf"hook {site}\.{last} never ran although the llama model ran forward"):
        with steered(lm, add(last, vector(lm), site)):
            loglikelihood(lm, REQUESTS)
    assert not lm.hooks.active


def test_residual_stream_that_is_not_batch_seq_hidden_is_refused(llama_path):
    lm = load(str(llama_path))
    d = len(vector(lm))
    block = decoder_layers(lm.model)[0]
    with pytest.raises(HookError, match=r"resid_pre\.0: the llama model's residual stream has shape \(5, 64\)") as e:
        with lm.hooks.installed([("resid_pre.0", Capture("last"))]):
            block(mx.zeros((5, d)))  # e.g. an architecture that flattens [batch * seq, hidden]
    assert "\n" not in str(e.value)


# --- branch sites: attn_out, mlp_out, resid_mid ----------------------------------------------------


BY_HAND = {"glm4": ("post_self_attn_layernorm", "post_mlp_layernorm"), "afmoe": ("post_attention_layernorm", "post_mlp_layernorm")}


def branch_module(block, point: str):
    """The module whose output the block adds to its residual stream, found by hand per family."""
    family = type(block).__module__.rpartition(".")[2]
    if family in BY_HAND:  # read off their blocks' __call__ in mlx-lm
        return getattr(block, BY_HAND[family][point == "mlp_out"])
    if point == "attn_out":
        post = getattr(block, "post_feedforward_layernorm", None) and block.post_attention_layernorm
        return post or getattr(block, "self_attn", None) or block.attn
    post = getattr(block, "post_feedforward_layernorm", None)
    return post or getattr(block, "mlp", None) or block.block_sparse_moe


@contextlib.contextmanager
def shifted_branch(model, layer: int, point: str, shift):
    """The plain model with the branch output `point` of block `layer` passed through `shift` (an instance patch)."""
    with shifted_module(branch_module(forward_list(model)[layer], point), shift):
        yield


@pytest.mark.parametrize("site", ["attn_out", "mlp_out"])
def test_add_at_a_branch_output_equals_shifting_that_branch_by_hand(models, site):
    arch, lm, plain = models
    v = vector(lm, seed=1)
    ours = run(lm, add(MIDDLE, v, site))
    with shifted_branch(plain, MIDDLE, site, lambda y: y + ALPHA * mx.array(v)):
        manual = plain(mx.array(TOKENS))
    assert mx.allclose(ours, manual, atol=1e-5).item(), arch
    assert not mx.allclose(ours, plain(mx.array(TOKENS)), atol=1e-2).item(), arch
    assert mx.array_equal(lm.model(mx.array(TOKENS)), plain(mx.array(TOKENS))).item(), arch  # all removed


def test_branch_captures_add_up_to_the_residual_stream(models):
    arch, lm, _ = models
    names = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")
    caps = {n: Capture("all") for n in names}
    with lm.hooks.installed([(f"{n}.{MIDDLE}", caps[n]) for n in names]), lm.hooks.forward(Rows()):
        out = lm.model(mx.array(TOKENS))
    assert mx.array_equal(out, run(lm)).item(), arch  # capturing changes nothing
    for b in range(len(TOKENS)):
        pre, attn, mid, mlp, post = (caps[n].records[0][b] for n in names)
        assert mx.array_equal(mid, pre + attn).item(), arch  # the block's own x + attn_out, bit for bit
        assert mx.allclose(post, mid + mlp, atol=1e-5).item(), arch


def test_resid_mid_add_equals_attn_out_add(models):
    arch, lm, _ = models
    v = vector(lm, seed=2)
    mid, attn = run(lm, add(MIDDLE, v, "resid_mid")), run(lm, add(MIDDLE, v, "attn_out"))
    assert mx.allclose(mid, attn, atol=1e-5).item(), arch
    assert not mx.allclose(mid, run(lm), atol=1e-2).item(), arch


def tiny(family: str, **extra):
    """An mlx-lm model of `family` built in memory with random weights (families the testbed does not write)."""
    import importlib

    mod = importlib.import_module(f"mlx_lm.models.{family}")
    mx.random.seed(0)
    args = dict(model_type=family, hidden_size=32, num_hidden_layers=LAYERS, intermediate_size=64, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, vocab_size=512, **extra)
    fields = mod.ModelArgs.__dataclass_fields__
    model = mod.Model(mod.ModelArgs(**{k: v for k, v in args.items() if k in fields}))
    mx.eval(model.parameters())
    return model


POST_NORM_FAMILIES = {
    "gemma2": {}, "gemma3_text": {}, "olmo2": {},
    "glm4": {"partial_rotary_factor": 0.5, "attention_bias": False, "rope_theta": 1e4},  # its post_attention_layernorm is pre-MLP
    "afmoe": {"layer_types": ["full_attention", "sliding_attention", "full_attention"], "rope_theta": 1e4},
}


@pytest.mark.parametrize("family", POST_NORM_FAMILIES)
@pytest.mark.parametrize("site", ["attn_out", "mlp_out"])
def test_post_branch_norm_families_steer_the_branch_as_it_is_added(family, site):
    """gemma2/3, olmo2, glm4 and afmoe normalise each branch's output before adding it: the site is after that norm."""
    model = tiny(family, sliding_window_pattern=2, sliding_window=4, **POST_NORM_FAMILIES[family])
    x = mx.array(TOKENS)
    plain = model(x)
    shift = 0.5 * mx.random.normal((32,), key=mx.random.key(3))
    with shifted_branch(model, MIDDLE, site, lambda y: y + shift):
        manual = model(x)
    hooks = instrument(model)
    assert mx.array_equal(model(x), plain).item()  # instrumented, nothing installed: bitwise the plain model
    with hooks.installed([(f"{site}.{MIDDLE}", lambda y, ctx: y + shift)]), hooks.forward(Rows()):
        ours = model(x)
    assert mx.allclose(ours, manual, atol=1e-5).item() and not mx.allclose(ours, plain, atol=1e-3).item()
    mid, attn = Capture("all"), Capture("all")
    pre = Capture("all")
    points = [(f"resid_pre.{MIDDLE}", pre), (f"attn_out.{MIDDLE}", attn), (f"resid_mid.{MIDDLE}", mid)]
    with hooks.installed(points), hooks.forward(Rows()):
        model(x)
    assert mx.array_equal(mid.records[0][0], pre.records[0][0] + attn.records[0][0]).item()


def test_a_parallel_block_has_no_resid_mid_and_says_so_in_one_line():
    model = tiny("phi", layer_norm_eps=1e-5, partial_rotary_factor=0.5)
    hooks = instrument(model)
    with pytest.raises(HookError, match=r"resid_mid\.1: the phi block runs attention and MLP in parallel .*no resid_mid: steer attn_out") as e:
        with hooks.installed([("resid_mid.1", Capture("last"))]):
            pass
    assert "\n" not in str(e.value) and not hooks.active
    with hooks.installed([("attn_out.1", Capture("last")), ("mlp_out.1", Capture("last"))]), hooks.forward(Rows()):
        model(mx.array(TOKENS))  # its branch outputs are there, and both ran


# --- branches other families name otherwise, hybrids' attention layers, scaled branches ---------------------------


def tiny_family(family: str):
    """A tiny mlx-lm `family` model with evaluated random weights, from the coverage bench's per-family args."""
    import sys
    from pathlib import Path

    bench = str(Path(__file__).resolve().parents[1] / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import coverage_sites

    assert max(map(max, TOKENS)) < coverage_sites.VOCAB  # in range of every family's embedding table
    return coverage_sites.build(family)


def in_fresh_process(check: str, *args) -> None:
    """Run `check(*args)` of this module in a new Python process with one BLAS thread (families' modules patched
    by one check never leak into another)."""
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve()
    code = f"import sys; sys.path[:0] = [{str(here.parent)!r}, {str(here.parents[1])!r}]; import {here.stem} as t; t.{check}(*{args!r})"
    one_thread = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=os.environ | one_thread)
    assert done.returncode == 0, done.stderr[-3000:]


# family: (layer, the attention branch's module, the MLP branch's module), read off each block's __call__ in mlx-lm:
# the module whose output the block adds to its residual stream (at a layer whose block has attention)
BRANCHES_BY_HAND = {
    "dbrx": (1, "norm_attn_norm.attn", "ffn"),  # NormAttnNorm adds attn's output, returns (x, norm_2(x))
    "exaone": (1, "attn.attention", "mlp"),  # h = x + self.attn.attention(...)
    "plamo3": (1, "post_mixer_norm", "post_mlp_norm"),  # residual + post_mixer_norm(mixer(...))
    "plamo2": (1, "post_mixer_norm", "post_mlp_norm"),  # layers 1, 3: Attention mixers (0, 2: Mamba)
    "phixtral": (1, "mixer", "moe"),  # attn_h + ff_h + x
    "talkie": (1, "attn_gain", "mlp_gain"),  # x + attn_gain(attn(...)): the learned gain is part of the branch
    "qwen3_next": (3, "self_attn", "mlp"),  # layer 3: full attention (0-2: linear attention)
    "jamba": (1, "self_attn", "feed_forward"),
    "lfm2": (1, "self_attn", "feed_forward"),
    "recurrent_gemma": (2, "temporal_block", "mlp_block"),  # layer 2: LocalAttentionBlock
    "olmo_hybrid": (3, "post_attention_layernorm", "post_feedforward_layernorm"),
}


def module_at(block, path: str):
    for name in path.split("."):
        block = getattr(block, name)
    return block


@contextlib.contextmanager
def shifted_module(module, shift):
    """`module`'s output passed through `shift` (an instance patch: the block's own __call__ runs as written)."""
    cls = type(module)

    class Shifted(cls):
        def __call__(self, *args, **kwargs):
            out = cls.__call__(self, *args, **kwargs)
            return (shift(out[0]), *out[1:]) if isinstance(out, tuple) else shift(out)

    module.__class__ = Shifted
    try:
        yield
    finally:
        module.__class__ = cls


@pytest.mark.parametrize("family", BRANCHES_BY_HAND)
@pytest.mark.parametrize("site", ["attn_out", "mlp_out"])
def test_each_familys_branch_is_steered_as_its_block_adds_it(family, site):
    """Adding at attn_out / mlp_out equals shifting, by hand, the module whose output the family's own block adds;
    resid_mid captures resid_pre + attn_out bit for bit (not in phixtral's parallel block, which has none)."""
    in_fresh_process("branch_as_added", family, site)


def branch_as_added(family: str, site: str) -> None:
    model = tiny_family(family)
    layer, *paths = BRANCHES_BY_HAND[family]
    block = decoder_layers(model)[layer]
    x = mx.array(TOKENS)
    plain = model(x)
    hooks = instrument(model)
    assert mx.array_equal(model(x), plain).item()  # nothing installed: bitwise the plain model
    width = Capture("last")
    with hooks.installed([(f"resid_pre.{layer}", width)]), hooks.forward(Rows()):
        model(x)
    shift = 0.5 * mx.random.normal((width.records[0].shape[-1],), key=mx.random.key(3))
    with shifted_module(module_at(block, paths[site == "mlp_out"]), lambda y: y + shift):  # the block's own add
        manual = model(x)
    with hooks.installed([(f"{site}.{layer}", lambda y, ctx: y + shift)]), hooks.forward(Rows()):
        ours = model(x)
    assert mx.allclose(ours, manual, atol=1e-5).item(), mx.abs(ours - manual).max().item()
    assert not mx.allclose(ours, plain, atol=1e-3).item()
    if family == "phixtral":
        return
    caps = {n: Capture("all") for n in ("resid_pre", "attn_out", "resid_mid")}
    with hooks.installed([(f"{n}.{layer}", c) for n, c in caps.items()]), hooks.forward(Rows()):
        model(x)
    pre, attn, mid = (caps[n].records[0][0] for n in ("resid_pre", "attn_out", "resid_mid"))
    assert mx.array_equal(mid, pre + attn).item()


@pytest.mark.parametrize("family", ["granite", "minicpm"])
def test_scaled_branches_are_the_modules_outputs_and_resid_mid_is_the_scaled_sum(family):
    """granite (residual_multiplier 0.22) and minicpm (scale_depth / sqrt(layers)) add each branch times a number:
    attn_out is the module's output (lm-eval `steered` at layers.L.self_attn), the residual receives it scaled;
    resid_mid is the block's own x + attn_out * scale, and adding v there is adding v / scale to attn_out."""
    in_fresh_process("scaled_branches", family)


def scaled_branches(family: str) -> None:
    from worker.hooks.branches import scale

    model = tiny_family(family)
    block = decoder_layers(model)[MIDDLE]
    factor = scale(block)
    assert factor is not None and factor != 1
    x = mx.array(TOKENS)
    shift = 0.5 * mx.random.normal((64,), key=mx.random.key(4))
    with shifted_module(block.self_attn, lambda y: y + shift / factor):
        manual = model(x)
    hooks = instrument(model)
    with hooks.installed([(f"resid_mid.{MIDDLE}", lambda y, ctx: y + shift)]), hooks.forward(Rows()):
        ours = model(x)
    assert mx.allclose(ours, manual, atol=1e-4).item() and not mx.allclose(ours, model(x), atol=1e-3).item()
    caps = {n: Capture("all") for n in ("resid_pre", "attn_out", "resid_mid")}
    with hooks.installed([(f"{n}.{MIDDLE}", c) for n, c in caps.items()]), hooks.forward(Rows()):
        model(x)
    pre, attn, mid = (caps[n].records[0][0] for n in ("resid_pre", "attn_out", "resid_mid"))
    assert mx.array_equal(mid, pre + attn * factor).item()


def test_the_residual_stream_argument_is_found_by_its_name():
    """talkie's blocks are called `block(e_x, x, mask, cache)`: resid_pre is `x` (the residual stream), not the
    embedding skip `e_x` that comes first."""
    in_fresh_process("residual_argument_by_name")


def residual_argument_by_name() -> None:
    model = tiny_family("talkie")
    blocks = decoder_layers(model)
    x = mx.array(TOKENS)
    shift = mx.random.normal((64,), key=mx.random.key(5))
    block = blocks[MIDDLE]
    blocks[MIDDLE] = lambda e_x, h, *args, **kwargs: block(e_x, h + shift, *args, **kwargs)
    manual = model(x)
    blocks[MIDDLE] = block
    hooks = instrument(model)
    with hooks.installed([(f"resid_pre.{MIDDLE}", lambda y, ctx: y + shift)]), hooks.forward(Rows()):
        ours = model(x)
    assert mx.allclose(ours, manual, atol=1e-5).item() and not mx.allclose(ours, model(x), atol=1e-3).item()
