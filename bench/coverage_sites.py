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
from worker.hooks.branches import scale  # noqa: E402
from worker.spec import SITES, site_missing  # noqa: E402

from coverage_args import BIG, LAYERS, OVERRIDES, TINY, TOKENS, VOCAB  # noqa: E402


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


def tiny_config(family: str) -> dict:
    """The config.json dict of a tiny `family` model (what mlx-lm's ModelArgs.from_dict reads)."""
    mod = importlib.import_module(f"mlx_lm.models.{family}")
    fields = {f.name for f in dataclasses.fields(mod.ModelArgs)}
    config = {k: v for k, v in TINY.items() if k in fields}
    config = {**config, "model_type": family, **OVERRIDES.get(family, {})}
    if "text_config" in fields and "text_config" not in OVERRIDES.get(family, {}):
        config["text_config"] = {**TINY, "model_type": family, **config.get("text_config", {})}
    return config


def tiny_args(family: str, mod) -> object:
    return mod.ModelArgs.from_dict(tiny_config(family))


def build(family: str):
    mod = importlib.import_module(f"mlx_lm.models.{family}")
    mx.random.seed(0)
    model = mod.Model(tiny_args(family, mod))
    # Weights a family initialises to zeros (talkie's lm_head) would hide every edit from the logits: randomise them.
    zeros = [(k, v) for k, v in tree_flatten(model.parameters()) if v.ndim >= 2 and not mx.any(v).item()]
    model.update(tree_unflatten([(k, 0.02 * mx.random.normal(v.shape).astype(v.dtype)) for k, v in zeros]))
    mx.eval(model.parameters())
    return model.eval()  # as mlx_lm.load leaves it (MoE blocks such as dbrx's take another path in training mode)


def forward(model, hooks=None):
    x = mx.array(TOKENS)
    if hooks is None:
        out = model(x)
    else:
        with hooks.forward(Rows()):
            out = model(x)
    mx.eval(out)
    return out


def site_layer(hooks, site: str, middle: int) -> int:
    """The layer a site is tried at: the middle one, else the nearest that has it (hybrids: attention on some layers)."""
    having = [i for i in range(hooks.n_layers) if not site_missing(hooks.missing, site, i)]
    return min(having, key=lambda i: (abs(i - middle), i)) if having else middle


def try_site(model, hooks, site: str, layer: int, plain) -> str:
    """'ok', 'refused: why' or 'FAIL: why' for one site: a Capture, then an add of a vector of the captured width."""
    why = site_missing(hooks.missing, site, layer)
    if why:
        return f"refused: {why}"
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


def adds_up(model, hooks, middle: int) -> str:
    """Whether resid_mid == resid_pre + attn_out and resid_post ~ resid_mid + mlp_out at the layer nearest the
    middle that has all five sites; in blocks that scale both branches before adding them (granite's
    residual_multiplier, minicpm's scale_depth) the branches are the modules' outputs, so the sums are scaled too."""
    names = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")
    having = [i for i in range(hooks.n_layers) if not any(site_missing(hooks.missing, n, i) for n in names)]
    if not having:
        return "n/a"
    layer = min(having, key=lambda i: (abs(i - middle), i))
    caps = {n: Capture("last") for n in names}
    try:
        with hooks.installed([(f"{n}.{layer}", caps[n]) for n in names]):
            forward(model, hooks)
    except Exception as e:  # noqa: BLE001
        return f"FAIL: {first_line(e)}"
    pre, attn, mid, mlp, post = (caps[n].records[0] for n in names)
    factor = scale(decoder_layers(model)[layer])
    if factor is not None:  # as the block computes it: x + r * multiplier
        attn, mlp = attn * factor, mlp * factor
    pre, attn, mid, mlp, post = (a.astype(mx.float32) for a in (pre, attn, mid, mlp, post))
    if not mx.array_equal(mid, pre + attn).item():
        return f"FAIL: resid_mid != resid_pre + attn_out (max {mx.abs(mid - pre - attn).max().item():.3g})"
    if not mx.allclose(post, mid + mlp, atol=1e-4).item():
        return f"FAIL: resid_post != resid_mid + mlp_out (max {mx.abs(post - mid - mlp).max().item():.3g})"
    return "ok" if factor is None else f"ok: branches scaled by {factor:.3g}"


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
    middle = n // 2
    row.update(build=None, instrument=None, layer=middle, n_layers=n)
    row["noop"] = "ok" if mx.array_equal(forward(model), plain).item() else "FAIL"
    for site in SITES:
        layer = site_layer(hooks, site, middle)
        row[site] = try_site(model, hooks, site, layer, plain)
        row[f"{site}_layers"] = layers_refused(hooks, site)
    row["adds_up"] = adds_up(model, hooks, middle)
    return row


def layers_refused(hooks, site: str) -> list[str]:
    """Each per-layer refusal of a site some other layer has (its one-line message), tried through `installed`."""
    out = []
    for i in range(hooks.n_layers):
        if f"{site}.{i}" in hooks.missing:
            try:
                with hooks.installed([(f"{site}.{i}", Capture("last"))]):
                    pass
                out.append(f"FAIL: {site}.{i} installed though missing")
            except HookError as e:
                out.append(str(e))
    return out


def short(result: str) -> str:
    return result.split(":")[0]


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
    per_layer = [(r["family"], m) for r in built for s in SITES for m in r.get(f"{s}_layers", [])[:1]]
    print(f"\nrefused at some layers only (first refusal per family and site; {len(per_layer)}):")
    for family, message in per_layer:
        print(f"  {family}: {message}")
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


def skeleton_cost(name: str | None) -> None:
    """Time and RSS growth of worker.hooks.skeleton.missing_sites on real-size configs, each in a fresh process."""
    if name is None:
        for big in BIG:
            subprocess.run([sys.executable, __file__, "--big", big], check=True)
        return
    import time

    from worker.hooks.skeleton import missing_sites

    def rss() -> float:
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20  # Linux; pages of 4 KiB

    before, start = rss(), time.perf_counter()
    missing = missing_sites(BIG[name])
    print(f"{name}: {time.perf_counter() - start:.3f} s, RSS +{rss() - before:.1f} MB, MLX active "
          f"{mx.get_active_memory() / 2**20:.1f} MB, {len(missing)} refusals")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="*", help="only these families (default: every one)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one family, one JSON line
    parser.add_argument("--skeleton", action="store_true", help="the driver's check cost on real-size configs")
    parser.add_argument("--big", help=argparse.SUPPRESS)  # the child process: one real-size config
    args = parser.parse_args()
    if args.skeleton or args.big:
        skeleton_cost(args.big)
        return
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
