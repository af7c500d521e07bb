"""Hook coverage over every model family mlx-lm builds (issue 18 item 5): for each family, a tiny random-weight
model is built in memory (offline), instrumented, and every site of `worker.spec.SITES` at a middle layer is
tried: refused in one line (`hooks.missing`), or a Capture and an `add` run through one forward.

    python bench/coverage_sites.py                 # every family; ~8 min on a busy 2-core CPU box
    python bench/coverage_sites.py llama gemma2    # some families only

Per family it also checks that instrumenting is bitwise a no-op (logits before == after, nothing installed)
and that the captures add up: resid_mid == resid_pre + attn_out (bitwise), resid_post ~ resid_mid + mlp_out.
Tiny args are derived from each ModelArgs' fields (tiny widths, 4 layers, vocab 256); the families whose own
defaults do not fit that get overrides copied from mlx-lm's tests/test_models.py (ml-explore/mlx-lm), except
granite*'s residual_multiplier: 0.22 (granite-3's own value; the tests' 1.0 hides the branch scaling). Each
family runs in a child process, so one that crashes MLX (phi3small segfaults on CPU) is one row, not the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
import mlx_lm.models  # noqa: E402
from mlx.utils import tree_flatten, tree_unflatten  # noqa: E402

from worker.hooks import Capture, HookError, Rows, decoder_layers, instrument  # noqa: E402
from worker.spec import SITES  # noqa: E402

from coverage_args import LAYERS, OVERRIDES, TINY, TOKENS, VOCAB  # noqa: E402


HELPERS = {"base", "cache", "rope_utils", "switch_layers", "pipeline", "activations", "bitlinear_layers",
           "gated_delta", "mla", "ssm"}


def families() -> list[str]:
    """Every module of mlx_lm.models that defines Model and ModelArgs (helpers excluded)."""
    names = [m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__) if m.name not in HELPERS]
    out = []
    for name in sorted(names):
        try:
            mod = importlib.import_module(f"mlx_lm.models.{name}")
        except (Exception, SystemExit) as e:  # noqa: BLE001 - olmo exits when ai2-olmo is missing: reported as such
            out.append((name, f"import: {first_line(e)}"))
            continue
        if hasattr(mod, "Model") and hasattr(mod, "ModelArgs"):
            out.append((name, None))
    return out


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:150]


def tiny_args(family: str, mod) -> object:
    fields = {f.name for f in dataclasses.fields(mod.ModelArgs)}
    config = {k: v for k, v in TINY.items() if k in fields}
    config = {**config, "model_type": family, **OVERRIDES.get(family, {})}
    if "text_config" in fields and "text_config" not in OVERRIDES.get(family, {}):
        config["text_config"] = {**TINY, "model_type": family, **config.get("text_config", {})}
    return mod.ModelArgs.from_dict(config)


def build(family: str):
    mod = importlib.import_module(f"mlx_lm.models.{family}")
    mx.random.seed(0)
    model = mod.Model(tiny_args(family, mod))
    # Weights a family initialises to zeros (talkie's lm_head) would hide every edit from the logits: randomise them.
    zeros = [(k, v) for k, v in tree_flatten(model.parameters()) if v.ndim >= 2 and not mx.any(v).item()]
    model.update(tree_unflatten([(k, 0.02 * mx.random.normal(v.shape).astype(v.dtype)) for k, v in zeros]))
    mx.eval(model.parameters())
    return model


def forward(model, hooks=None):
    x = mx.array(TOKENS)
    if hooks is None:
        out = model(x)
    else:
        with hooks.forward(Rows()):
            out = model(x)
    mx.eval(out)
    return out


def try_site(model, hooks, site: str, layer: int, plain) -> str:
    """'ok', 'refused: why' or 'FAIL: why' for one site: a Capture, then an add of a vector of the captured width."""
    if site in hooks.missing:
        return f"refused: {hooks.missing[site]}"
    name = f"{site}.{layer}"
    cap = Capture("last")
    try:
        with hooks.installed([(name, cap)]):
            out = forward(model, hooks)
        if not mx.array_equal(out, plain).item():
            return "FAIL: capturing changed the logits"
        width = cap.records[0].shape[-1]
        shift = mx.random.normal((width,), key=mx.random.key(1))
        with hooks.installed([(name, lambda y, ctx: y + shift)]):
            out = forward(model, hooks)
        if mx.allclose(out, plain, atol=1e-6).item():
            return "FAIL: add changed nothing"
    except HookError as e:
        return f"FAIL: {'never ran' if 'never ran' in str(e) else 'HookError'}: {first_line(e)}"
    except Exception as e:  # noqa: BLE001 - every other error is a finding, reported in one line
        return f"FAIL: {first_line(e)}"
    return "ok"


def adds_up(model, hooks, layer: int) -> str:
    """Whether resid_mid == resid_pre + attn_out and resid_post ~ resid_mid + mlp_out at `layer`."""
    names = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")
    if any(n in hooks.missing for n in names):
        return "n/a"
    caps = {n: Capture("last") for n in names}
    try:
        with hooks.installed([(f"{n}.{layer}", caps[n]) for n in names]):
            forward(model, hooks)
    except Exception as e:  # noqa: BLE001
        return f"FAIL: {first_line(e)}"
    pre, attn, mid, mlp, post = (caps[n].records[0].astype(mx.float32) for n in names)
    if not mx.array_equal(mid, pre + attn).item():
        return f"FAIL: resid_mid != resid_pre + attn_out (max {mx.abs(mid - pre - attn).max().item():.3g})"
    if not mx.allclose(post, mid + mlp, atol=1e-4).item():
        return f"FAIL: resid_post != resid_mid + mlp_out (max {mx.abs(post - mid - mlp).max().item():.3g})"
    return "ok"


def check_family(family: str) -> dict:
    row = {"family": family}
    try:
        model = build(family)
        plain = forward(model)
        n = len(decoder_layers(model))
    except Exception as e:  # noqa: BLE001 - a family the generic tiny args do not build: not a hook finding
        return {**row, "build": first_line(e)}
    try:
        hooks = instrument(model)
    except Exception as e:  # noqa: BLE001
        return {**row, "build": None, "instrument": first_line(e)}
    layer = n // 2
    row.update(build=None, instrument=None, layer=layer, n_layers=n)
    row["noop"] = "ok" if mx.array_equal(forward(model), plain).item() else "FAIL"
    for site in SITES:
        row[site] = try_site(model, hooks, site, layer, plain)
    row["adds_up"] = adds_up(model, hooks, layer)
    return row


def short(result: str) -> str:
    return "ok" if result == "ok" else result.split(":")[0]


def report(rows: list[dict]) -> None:
    built = [r for r in rows if r.get("build") is None and r.get("instrument") is None]
    print(f"mlx-lm {mlx_lm.__version__}, mlx {mx.__version__}: {len(rows)} families, {len(built)} built and instrumented")
    print(f"{'family':<24}" + "".join(f"{s:<11}" for s in SITES) + "noop  adds_up")
    for r in rows:
        if r not in built:
            print(f"{r['family']:<24}NOT BUILT: {r.get('build') or r.get('instrument')}")
            continue
        print(f"{r['family']:<24}" + "".join(f"{short(r[s]):<11}" for s in SITES) + f"{r['noop']:<6}{short(r['adds_up'])}")
    print()
    for site in SITES:
        results = [r[site] for r in built]
        refused = {x.split(": ", 1)[1] for x in results if x.startswith("refused")}
        print(f"{site}: {results.count('ok')} ok, {sum(x.startswith('refused') for x in results)} refused "
              f"({'one line' if all(chr(10) not in x for x in refused) else 'MULTI-LINE'}), "
              f"{sum(x.startswith('FAIL') for x in results)} fail of {len(built)} families")
    noop = sum(r["noop"] == "ok" for r in built)
    print(f"instrumenting bitwise a no-op: {noop} of {len(built)}; captures add up: "
          f"{sum(r['adds_up'] == 'ok' for r in built)} ok, {sum(r['adds_up'] == 'n/a' for r in built)} n/a")
    print("\nrefused and failing (family site: reason):")
    for r in built:
        for key in (*SITES, "adds_up"):
            if r[key] not in ("ok", "n/a"):
                print(f"  {r['family']} {key}: {r[key]}")


def isolated(family: str) -> dict:
    """check_family in a child process: a family whose tiny build crashes MLX (abort, segfault) is one row, not the run."""
    done = subprocess.run([sys.executable, __file__, "--one", family], capture_output=True, text=True, timeout=300)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"family": family, "build": f"child process exit {done.returncode}: {tail}"[:150]}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="*", help="only these families (default: every one)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one family, one JSON line
    args = parser.parse_args()
    if args.one:
        print(json.dumps(check_family(args.one)))
        return
    rows = []
    for family, problem in families():
        if args.families and family not in args.families:
            continue
        rows.append({"family": family, "build": problem} if problem else isolated(family))
    report(rows)


if __name__ == "__main__":
    main()
