"""Every way a user can get `driver` wrong, as a real user meets it: the real entry point, `driver.cli.main` in
click's standalone mode, run in this process with the case's environment (testbed.inproc), or `python -m driver
...` in a subprocess where a fresh process is the point (FRESH_PROCESS, `--help`, the cluster cases).

Each case asserts the exact exit code (2: the command line itself is wrong; 1: it names something unusable, or
something failed), that stderr is one `Error:` line (plus at most one `Try ... --help` hint), that there is no
traceback, and that nothing was half-written (no output folder, a refused cache file unchanged). The time to
each error is measured, never asserted: `pytest tests/test_errors.py -s` prints the table at the end (and
`python bench/bench_errors.py` prints the pre-flight table alone).

The cluster cases run a real token-authenticated Ray cluster of two nodes on loopback (`ray start`, in a temp
HOME and RAY_TMPDIR of their own), stopped at the end by killing exactly the processes it started.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from testbed import inproc
from testbed.inproc import Completed
from testbed.waiting import until

TIMES: list[tuple[str, str, int, float]] = []  # (group, case, exit code, seconds to the error)


@dataclass
class World:
    """What the cases point at: a tiny model, offline tasks, and a scratch folder per case."""

    model: Path
    tasks: Path
    tmp: Path
    env: dict[str, str] = field(default_factory=dict)


def driver(*args: str, env: dict[str, str], cwd: Path, timeout: float = 240) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "driver", *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout
    )
    return proc, time.perf_counter() - start


def in_process(*args: str, env: dict[str, str], cwd: Path) -> tuple[Completed, float]:
    """`driver ARGS` as `driver` does it, in this process (testbed.inproc), with `env` as the whole environment for
    the call (variables it lacks are unset meanwhile); not connected to Ray (`_no_ray_connection`)."""
    start = time.perf_counter()
    delta: dict[str, str | None] = {k: None for k in os.environ if k not in env}
    delta.update({k: v for k, v in env.items() if os.environ.get(k) != v})
    proc = inproc.driver(*args, cwd=cwd, env=delta)
    return proc, time.perf_counter() - start


def assert_one_line_error(proc: subprocess.CompletedProcess | Completed, code: int, message: str) -> str:
    """Exit code exactly `code`; stderr one `Error:` line containing `message` (+ at most a `Try` hint)."""
    shown = f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr + proc.stdout, shown
    assert proc.returncode == code, shown
    # the phase lines of a refusal after Ray started (`driver: ...`) come before it; tests/test_ux_phases checks
    # that a refusal before Ray has none
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("driver: ")]
    assert 1 <= len(lines) <= 2 and lines[0].startswith("Error: "), shown
    assert len(lines) == 1 or lines[1].startswith("Try '"), shown
    assert message in lines[0], shown
    return lines[0]


def base_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS", "PYTEST_"))}
    env.update(
        HOME=str(home), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_USAGE_STATS_ENABLED="0", TOKENIZERS_PARALLELISM="false", HF_HOME=str(home / "hf"),
        RAY_TMPDIR=tempfile.mkdtemp(prefix="oh", dir="/tmp"),  # short: Ray's socket paths must stay < 108 bytes
    )  # fmt: skip  (under pytest-xdist, home sits one folder deeper: popen-gwN/)
    return env


@pytest.fixture(scope="module")
def world(llama_path, tasks_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    yield World(llama_path, tasks_dir, tmp_path_factory.mktemp("cases"), base_env(home))


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    if TIMES:
        print(f"\n{'group':<10} {'case':<34} {'exit':>4} {'time to error (s)':>18}")
        for group, case, code, seconds in TIMES:
            print(f"{group:<10} {case:<34} {code:>4} {seconds:>18.2f}")
        pre = [s for g, _, _, s in TIMES if g in ("settings", "preflight")]
        if pre:
            print(f"pre-flight and settings cases: {len(pre)}, median {sorted(pre)[len(pre) // 2]:.2f} s, max {max(pre):.2f} s")


# --- the table ------------------------------------------------------------------------------------------------------

Setup = Callable[[World, Path], list[str]]  # writes what the case needs under its folder; returns extra args


@dataclass
class Case:
    name: str
    command: str  # run | vectors | nodes
    args: list[str]  # after the common ones; {case} is the case's folder
    code: int
    message: str
    setup: Setup | None = None
    env: dict[str, str] = field(default_factory=dict)
    common: bool = True  # add --model/--tasks/--include-path/--workers/--output-path


def _file(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    return path


def _foreign_db(folder: Path) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(folder / "results.sqlite") as db:
        db.execute("CREATE TABLE users (id INTEGER, name TEXT)")
    return ["--cache", str(folder)]


def _no_weights(w: World, case: Path) -> list[str]:
    shutil.copytree(w.model, case / "model", ignore=shutil.ignore_patterns("*.safetensors"))
    return ["--model", str(case / "model")]


def _partial_hub(w: World, case: Path) -> list[str]:
    commit = "89abcdef0123456789abcdef0123456789abcdef"
    repo = Path(w.env["HF_HOME"]) / "hub" / "models--orchard-test--no-weights"
    shutil.copytree(w.model, repo / "snapshots" / commit, ignore=shutil.ignore_patterns("*.safetensors"), dirs_exist_ok=True)
    _file(repo / "refs" / "main", commit)
    return []


def _bad_config(w: World, case: Path) -> list[str]:
    shutil.copytree(w.model, case / "model")
    _file(case / "model" / "config.json", '{"model_type": "llama",\n  "hidden_size": 64,,\n}')
    return ["--model", str(case / "model")]


def _steer(w: World, case: Path, layer: int) -> list[str]:
    import numpy as np

    np.save(case / "v.npy", np.ones(64, dtype=np.float32))
    spec = _file(case / "steer.yaml", f"interventions:\n  - {{layer: {layer}, vector: v.npy, alpha: 1.0}}\n")
    return ["--steer", str(spec)]


def _pairs(w: World, case: Path) -> list[str]:
    _file(case / "pairs.jsonl", json.dumps({"positive": "happy day", "negative": "sad day"}) + "\n")
    return []


def _a_file(w: World, case: Path) -> list[str]:
    _file(case / "f", "x")
    return []


def _broken_yaml(w: World, case: Path) -> list[str]:
    _file(case / "yamls" / "broken.yaml", "task: broken\ndataset_path: json\n  oops: [x\n")
    return []


def _corrupt_cache(w: World, case: Path) -> list[str]:
    return ["--cache", str(_file(case / "cache" / "results.sqlite", b"\x00garbage" * 64).parent)]


VEC = ["--pairs", "{case}/pairs.jsonl", "--out", "{case}/v.safetensors", "--workers", "1"]

SETTINGS = [
    Case("batch-size 0", "run", ["--batch-size", "0"], 2, "--batch-size 0: too small: give an integer >= 1"),
    Case("batch-size auto", "run", ["--batch-size", "auto"], 2, "--batch-size auto: not a whole number"),
    Case("max-length 0", "run", ["--max-length", "0"], 2, "--max-length 0: too small: give an integer >= 2"),
    Case("max-length 1", "run", ["--max-length", "1"], 2, "--max-length 1: too small: give an integer >= 2"),
    Case("num-fewshot -1", "run", ["--num-fewshot", "-1"], 2, "--num-fewshot -1: too small: give an integer >= 0"),
    Case("limit nan", "run", ["--limit", "nan"], 2, "--limit nan: give a whole number of documents per task (>= 1), or a fraction"),
    Case("limit inf", "run", ["--limit", "inf"], 2, "--limit inf: give a whole number of documents"),
    Case("limit 2.5", "run", ["--limit", "2.5"], 2, "--limit 2.5: not a whole number: give a whole number"),
    Case("threads -1", "run", ["--threads", "-1"], 2, "--threads -1: too small: give an integer >= 1"),
    Case("gen-kwargs unknown key", "run", ["--gen-kwargs", "temprature=0"], 2, "unknown key 'temprature' (did you mean temperature?)"),
    Case("gen-kwargs not a number", "run", ["--gen-kwargs", "max_gen_toks=lots"], 2, "--gen-kwargs max_gen_toks=lots: not a whole number"),
    Case("gen-kwargs negative", "run", ["--gen-kwargs", "max_gen_toks=-5"], 2, "--gen-kwargs max_gen_toks=-5: too small"),
    Case("gen-kwargs top_p 2", "run", ["--gen-kwargs", "top_p=2"], 2, "--gen-kwargs top_p=2: nucleus sampling"),
    Case("model-args typo", "run", ["--model-args", "dtpye=float16"], 2, "unknown key 'dtpye' (did you mean dtype?)"),
    Case("model-args without =", "run", ["--model-args", "float16"], 2, "--model-args 'float16': expected key=value"),
    Case("model-args bad dtype", "run", ["--model-args", "dtype=float8"], 2, "--model-args dtype=float8: unknown value"),
    Case("model-args negative prefix cache", "run", ["--model-args", "prefix_cache_mb=-1"], 2,
         "--model-args prefix_cache_mb=-1: too small: give an integer >= 0 (MiB of prefix KV"),
    Case("model-args has a flag", "run", ["--model-args", "batch_size=4"], 2, "--model-args batch_size=4: set it with --batch-size"),
    Case("workers 0", "run", ["--workers", "0"], 2, "--workers 0: at least 1 worker is needed"),
    Case("seed 1,2", "run", ["--seed", "1,2"], 2, "--seed"),
    Case("address garbage", "run", ["--address", "garbage"], 2, "--address 'garbage' is not a Ray address"),
    Case("unknown option", "run", ["--modle", "x"], 2, "No such option '--modle'"),
    Case("nodes address garbage", "nodes", ["--address", "not:a:port"], 2, "--address 'not:a:port' is not a Ray address", common=False),
    Case("vectors threads 0", "vectors", [*VEC, "--threads", "0"], 2, "--threads 0: too small", common=False),
    Case("vectors model-args typo", "vectors", [*VEC, "--model-args", "max_lenght=64"], 2, "(did you mean max_length?)", common=False),
    Case("vectors position", "vectors", [*VEC, "--position", "middle"], 2, "--position middle: bad position", common=False),
    Case("vectors layer range", "vectors", [*VEC, "--layers", "7"], 2, "--layers 7: layer 7 is out of range", common=False,
         setup=_pairs),
]  # fmt: skip

PREFLIGHT = [
    Case("output path is a file", "run", ["--output-path", "{case}/f"], 1, "a file is in the way",
         setup=_a_file),
    Case("output path inside a file", "run", ["--output-path", "{case}/f/out"], 1, "/f is a file, not a folder",
         setup=_a_file),
    Case("output path read-only", "run", ["--output-path", "/sys/orchard-out"], 1, "cannot write in /sys"),
    Case("cache not sqlite", "run", [], 1, "is not an Orchard result cache (file is not a database): move it away",
         setup=_corrupt_cache),
    Case("cache foreign sqlite", "run", [], 1, "another program's database, not an Orchard result cache (tables: users)",
         setup=lambda w, c: _foreign_db(c / "cache")),
    Case("model path missing", "run", ["--model", "{case}/absent"], 1, "model path does not exist"),
    Case("model without weights", "run", [], 1, "no model*.safetensors weights", setup=_no_weights),
    Case("repo id offline, not cached", "run", ["--model", "orchard-test/not-cached"], 1,
         "model orchard-test/not-cached: no such local folder, and not in the Hugging Face cache while HF_HUB_OFFLINE=1"),
    Case("repo id cached without weights", "run", ["--model", "orchard-test/no-weights"], 1,
         "has its config and tokenizer but not its weights", setup=_partial_hub),
    Case("model config.json broken", "run", [], 1, "config.json is not valid JSON (Expecting property name", setup=_bad_config),
    Case("adapter path missing", "run", ["--model-args", "adapter_path={case}/none"], 1, "adapter_path=", ),
    Case("chat template missing", "run", ["--apply-chat-template"], 1, "--apply-chat-template: the tokenizer in"),
    Case("include path missing", "run", ["--include-path", "{case}/none"], 1, "no such folder of task YAMLs"),
    Case("malformed task YAML", "run", ["--include-path", "{case}/yamls", "--tasks", "broken"], 1, "broken.yaml:3:7: malformed YAML",
         setup=_broken_yaml),
    Case("unknown task (cold index)", "run", ["--tasks", "no_such_task"], 2, "unknown task no_such_task"),
    Case("unknown task (warm index)", "run", ["--tasks", "hellaswg"], 2, "unknown task hellaswg"),
    Case("steer file missing", "run", ["--steer", "{case}/none.yaml"], 1, "none.yaml"),
    Case("steer layer out of range", "run", [], 1, "interventions[0].layer: 9 is out of range", setup=lambda w, c: _steer(w, c, 9)),
    Case("RAY_ADDRESS garbage", "run", [], 1, "RAY_ADDRESS='garbage' is not a Ray address", env={"RAY_ADDRESS": "garbage"}),
    Case("address unreachable", "run", ["--address", "127.0.0.1:1"], 1, "cannot reach a Ray cluster at 127.0.0.1:1"),
    Case("address auto, none started", "run", ["--address", "auto"], 1, "--address auto: no Ray cluster was started with `ray start`"),
    Case("vectors pairs missing", "vectors", VEC, 1, "pairs file not found", common=False),
    Case("vectors out is a folder", "vectors", [*VEC[:2], "--out", "{case}", "--workers", "1"], 2, "--out", common=False,
         setup=_pairs),
]  # fmt: skip


def _spec(text: str) -> Setup:
    """A steering spec (YAML `text`) beside a 64-wide vector v.npy (the tiny llama's hidden size)."""

    def setup(w: World, case: Path) -> list[str]:
        import numpy as np

        np.save(case / "v.npy", np.linspace(-2, 2, 64).astype(np.float32))
        return ["--steer", str(_file(case / "steer.yaml", text))]

    return setup


def _head_spec(text: str) -> Setup:
    """`_spec`, plus h.npy: one head's width (head_dim 16: the tiny llama's 64 / 4 heads)."""

    def setup(w: World, case: Path) -> list[str]:
        import numpy as np

        np.save(case / "h.npy", np.linspace(-1, 1, 16).astype(np.float32))
        return _spec(text)(w, case)

    return setup


def _pairs_file(*lines: dict) -> Setup:
    def setup(w: World, case: Path) -> list[str]:
        _file(case / "pairs.jsonl", "".join(json.dumps(line) + "\n" if line else "\n" for line in lines))
        return []

    return setup


_HAPPY = {"positive": "the happy dog ran home", "negative": "the sad dog ran home"}
_SHORT = {"positive": "a yes", "negative": "a no"}

def _damaged_model(damage: Callable[[Path], object]) -> Setup:
    """A copy of the tiny llama with one file damaged by `damage(folder)`."""

    def setup(w: World, case: Path) -> list[str]:
        folder = Path(shutil.copytree(w.model, case / "model"))
        damage(folder)
        return ["--model", str(folder)]

    return setup


def _truncate(path: Path) -> None:
    with path.open("r+b") as fh:
        fh.truncate(path.stat().st_size // 2)


def _more_tokens(folder: Path) -> None:
    """Tokens added to the tokenizer until two ids have no row in the embedding table."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    rows = json.loads((folder / "config.json").read_text())["vocab_size"]
    tok.add_special_tokens([f"<extra_{i}>" for i in range(rows + 2 - tok.get_vocab_size())])
    tok.save(str(folder / "tokenizer.json"))


def _config_says(**changes) -> Setup:
    def damage(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **changes}))

    return _damaged_model(damage)


_HELD: list[int] = []  # output-folder locks this test process holds, as a running sweep would


def _sweep(w: World, case: Path, tasks: str = "", alphas: str = "[2.0]", prompt_set: str = "", model: str = "") -> list[str]:
    """A sweep file over the test model with one vector, a one-line prompt set and `tasks`; returns its path."""
    import numpy as np

    np.save(case / "v.npy", np.ones(64, dtype=np.float32))
    _file(case / "prompts.jsonl", json.dumps({"prompt": "The dog was", "targets": {"positive": " happy", "negative": " sad"}}) + "\n")
    text = (f"model: {{pretrained: {w.model}, max_length: 64{model}}}\nvectors:\n  v: {{layers: {{0: v.npy}}}}\n"
            f"grid: {{layers: [0], alphas: {alphas}}}\nprompts:\n  - {{file: prompts.jsonl, max_gen_toks: 4{prompt_set}}}\n{tasks}")  # fmt: skip
    return [str(_file(case / "sweep.yaml", text))]


def _busy_sweep(w: World, case: Path) -> list[str]:
    from driver.sweep import outdir

    _HELD.append(outdir.lock(case / "busy"))
    return _sweep(w, case)


SWEEP = ["--workers", "1", "--output", "{case}/out"]

# First contact (issue 15): one list per area, each owned by the code that makes the refusal.
STEERING_ROWS: list[Case] = [  # steering specs, vectors, pairs
    Case("steer alpha inf in float32", "run", [], 1, "steer.yaml: interventions[0].alpha: alpha reaches 1e+39, which is inf in float32",
         setup=_spec("interventions:\n  - {layer: 0, vector: v.npy, alpha: 1.0e+39}\n")),
    Case("steer alpha*v inf in float32", "run", [], 1, "interventions[0].alpha: alpha*vector reaches 6e+38, which is inf in float32",
         setup=_spec("interventions:\n  - {layer: 0, vector: v.npy, alpha: 3.0e+38}\n")),
    Case("steer alpha given twice", "run", [], 1, "steer.yaml: key 'alpha' is given twice (lines 4 and 5): keep one",
         setup=_spec("interventions:\n  - layer: 0\n    vector: v.npy\n    alpha: 2.0\n    alpha: 50.0\n")),
    Case("steer interventions given twice", "run", [], 1, "steer.yaml: key 'interventions' is given twice (lines 1 and 3)",
         setup=_spec("interventions:\n  - {layer: 0, vector: v.npy}\ninterventions: []\n")),
    Case("steer interventions with no value", "run", [], 1, "steer.yaml: interventions: has no value: list the interventions",
         setup=_spec("interventions:\n")),
    Case("steer negative layer out of range", "run", [], 1, "interventions[0].layer: -3 is out of range for a model with 2 layers",
         setup=_spec("interventions:\n  - {layer: -3, vector: {file: v.safetensors}}\n")),
    Case("sweep key given twice", "sweep", ["{case}/s.yaml"], 1, "s.yaml: key 'model' is given twice (lines 1 and 2): keep one",
         common=False, setup=lambda w, c: _file(c / "s.yaml", "model: {pretrained: a}\nmodel: {pretrained: b}\n") and []),
    Case("vectors sides identical", "vectors", VEC, 1, "pairs.jsonl: line 3: the positive and negative texts are the same tokens",
         common=False, setup=_pairs_file(_HAPPY, None, {"positive": "same", "negative": "same"})),
    Case("vectors pca-diff one pair", "vectors", [*VEC, "--method", "pca-diff"], 1, "pca-diff needs at least 2 pairs",
         common=False, setup=_pairs_file(_HAPPY)),
    Case("vectors pca-center one pair", "vectors", [*VEC, "--method", "pca-center"], 1, "pca-center needs at least 2 pairs",
         common=False, setup=_pairs_file(_HAPPY)),
    Case("vectors position -500", "vectors", [*VEC, "--position", "-500"], 1,
         "pairs.jsonl: line 1: position -500 is outside the 11 tokens of its positive text", common=False, setup=_pairs_file(_HAPPY)),
    Case("vectors position in a later pair", "vectors", [*VEC, "--position", "-5"], 1,
         "pairs.jsonl: line 3: position -5 is outside the 4 tokens of its negative text", common=False,
         setup=_pairs_file(_HAPPY, None, _SHORT)),
    Case("vectors position cut off", "vectors", [*VEC, "--position", "1", "--model-args", "max_length=4"], 1,
         "line 1: position 1 falls in the first 7 tokens, cut off to fit the model's context of 4, of the 11 tokens", common=False,
         setup=_pairs_file(_HAPPY)),
    Case("steer unknown site", "run", [], 1, "steer.yaml: interventions[0].site: 'attn_output' is not allowed (use one of: "
         "resid_pre, resid_mid, resid_post, attn_out, mlp_out, attn_head)", setup=_spec("interventions:\n  - {layer: 0, site: attn_output, vector: v.npy}\n")),
    Case("steer head out of range", "run", [], 1, "interventions[0].head: 4 is out of range for a model with 4 attention heads (use 0..3)",
         setup=_head_spec("interventions:\n  - {layer: 0, site: attn_head, head: 4, vector: h.npy}\n")),
    Case("steer head on a site without heads", "run", [], 1, "steer.yaml: interventions[0].head: `head` applies only to site attn_head, "
         "not attn_out: remove it or use site: attn_head", setup=_head_spec("interventions:\n  - {layer: 0, site: attn_out, head: 1, vector: v.npy}\n")),
    Case("steer attn_head without head", "run", [], 1, "steer.yaml: interventions[0].head: site attn_head needs `head: h`",
         setup=_head_spec("interventions:\n  - {layer: 0, site: attn_head, vector: h.npy}\n")),
    Case("steer attn_head hidden-size vector", "run", [], 1, "interventions[0].vector: has 64 values but attn_head takes head_dim = 16 values",
         setup=_head_spec("interventions:\n  - {layer: 1, site: attn_head, head: 2, vector: v.npy}\n")),
    Case("steer attn_head tensor split", "run", ["--group-size", "2", "--split", "tensor"], 2,
         "attn_head steering on a tensor-split group: each node holds only some heads of every layer: use --split pipeline",
         setup=_head_spec("interventions:\n  - {layer: 1, site: attn_head, head: 2, vector: h.npy}\n")),
    Case("vectors heads out of range", "vectors", [*VEC, "--site", "attn_head", "--heads", "0,9"], 2,
         "--heads 0,9: head 9 is out of range: the model has 4 heads (0..3)", common=False, setup=_pairs_file(_HAPPY)),
    Case("vectors heads without attn_head", "vectors", [*VEC, "--site", "attn_out", "--heads", "1"], 2,
         "--heads 1: heads apply only to --site attn_head, not attn_out: drop --heads", common=False, setup=_pairs_file(_HAPPY)),
    Case("vectors attn_head tensor split", "vectors", [*VEC, "--site", "attn_head", "--group-size", "2", "--split", "tensor"], 2,
         "--site attn_head: a tensor-split group holds each head on one node only: use --split pipeline", common=False,
         setup=_pairs_file(_HAPPY)),
    Case("vectors unknown site", "vectors", [*VEC, "--site", "mlp_output"], 2, "Invalid value for '--site': 'mlp_output' is not one of",
         common=False, setup=_pairs_file(_HAPPY)),
]  # fmt: skip
SWEEP_ROWS: list[Case] = [  # sweep files and their outputs
    Case("sweep second writer", "sweep", ["--workers", "1", "--output", "{case}/busy"], 1,
         "another sweep is writing to this folder", setup=_busy_sweep, common=False),
    Case("sweep unknown task", "sweep", SWEEP, 1, "tasks.names: unknown task 'no_such_task'", common=False,
         setup=lambda w, case: _sweep(w, case, tasks=f"tasks: {{names: [no_such_task], include_path: {w.tasks}}}\n")),
    Case("sweep alpha inf in float32", "sweep", SWEEP, 1, "grid.alphas: 1e+39 (vector v, layer 0, resid_post, add)", common=False,
         setup=lambda w, case: _sweep(w, case, alphas="[2.0, 1.0e+39]")),
    Case("sweep target_score typo", "sweep", SWEEP, 1, "prompts[0].target_score: 'avg' is not allowed (use 'sum' or 'mean')",
         setup=lambda w, case: _sweep(w, case, prompt_set=", target_score: avg"), common=False),
    Case("sweep output is a file", "sweep", ["--workers", "1", "--output", "{case}/f"], 1, "/f: a file is in the way", setup=lambda w, case: [*_a_file(w, case), *_sweep(w, case)], common=False),
    Case("sweep heads on a site without heads", "sweep", SWEEP, 1, "sweep.yaml: grid: heads: site resid_post has no heads: add "
         "attn_head to grid.sites, or remove grid.heads", common=False, setup=lambda w, case: _sweep(w, case, alphas="[2.0], heads: all")),
    Case("sweep head out of range", "sweep", SWEEP, 1, "sweep.yaml: grid.heads: 9 is out of range for a model with 4 attention heads "
         "(use 0..3, or all)", common=False, setup=lambda w, case: _sweep(w, case, alphas="[2.0], sites: [attn_head], heads: [0, 9]")),
    Case("sweep head vector of hidden size", "sweep", SWEEP, 1, "sweep.yaml: vectors.v.layers.0: has 64 values but attn_head takes "
         "head_dim = 16 values", common=False, setup=lambda w, case: _sweep(w, case, alphas="[2.0], sites: [attn_head], heads: [1]")),
]  # fmt: skip
MODEL_ROWS: list[Case] = [  # model files, tokenizer, tasks, run flags, demo
    Case("safetensors truncated", "run", [], 1, "model.safetensors is truncated: ",
         setup=_damaged_model(lambda m: _truncate(m / "model.safetensors"))),
    Case("safetensors not safetensors", "run", [], 1, "model.safetensors is not a safetensors file",
         setup=_damaged_model(lambda m: _file(m / "model.safetensors", b"\xff" * 4096))),
    Case("config hidden size mismatch", "run", [], 1,
         "config.json says hidden size 128 but model.embed_tokens.weight in model.safetensors is ", setup=_config_says(hidden_size=128)),
    Case("config vocab mismatch", "run", [], 1, "config.json says vocab_size 7 but model.embed_tokens.weight",
         setup=_config_says(vocab_size=7)),
    Case("tokenizer past the embedding", "run", [], 1, "tokens but config.json's vocab_size is ",
         setup=_damaged_model(_more_tokens)),
    Case("config more layers than weights", "run", [], 1, "config.json says 9 layers but the weights hold 2",
         setup=_config_says(num_hidden_layers=9)),
    Case("tokenizer.json malformed", "run", [], 1, "tokenizer.json is not valid JSON (Expecting property name",
         setup=_damaged_model(lambda m: _file(m / "tokenizer.json", '{"version": "1.0",\n'))),
    Case("tokenizer.json not a tokenizer", "run", [], 1, "tokenizer.json is not a tokenizer the `tokenizers` library can load",
         setup=_damaged_model(lambda m: _file(m / "tokenizer.json", '{"version": "1.0"}'))),
    Case("vectors tokenizer malformed", "vectors", VEC, 1, "tokenizer.json is not valid JSON", common=False,
         setup=_damaged_model(lambda m: (_file(m / "tokenizer.json", "{"), _pairs(None, m.parent)))),
    Case("num-fewshot beyond the examples", "run", ["--num-fewshot", "1000"], 2,
         "--num-fewshot 1000: task orchard_mc has 8 few-shot examples: give --num-fewshot 8 or less"),
    Case("demo workers 0", "demo", ["--workers", "0", "--dir", "{case}/out"], 2, "--workers 0: at least 1 worker is needed",
         common=False),
    Case("demo dir is a file", "demo", ["--dir", "{case}/f"], 1, "/f: a file is in the way (give a folder)", setup=_a_file,
         common=False),
]  # fmt: skip
GROUP_ROWS: list[Case] = [  # worker groups (issue 17): --group-size, --split, model_args, the sweep file's model block
    Case("group-size 0", "run", ["--group-size", "0"], 2, "--group-size 0: too small: give an integer >= 1"),
    Case("group-size words", "run", ["--group-size", "two"], 2, "--group-size two: not a whole number"),
    Case("split unknown", "run", ["--split", "diagonal"], 2, "--split diagonal: unknown value (choose one of auto, pipeline, tensor)"),
    Case("model-args group_size", "run", ["--model-args", "group_size=2"], 2, "--model-args group_size=2: set it with --group-size"),
    Case("pipeline more ranks than layers", "run", ["--group-size", "3", "--split", "pipeline"], 2,
         "group size 3 is larger than the model's 2 layers: a pipeline needs a layer per rank: use a group size of at most 2"),
    Case("tensor heads not divisible", "run", ["--group-size", "3", "--split", "tensor"], 2,
         "the model's 4 attention heads do not divide by group size 3: use a group size that divides 4, or --split pipeline"),
    Case("groups beyond this machine", "run", ["--workers", "500", "--group-size", "2", "--address", "local"], 1,
         "--workers 500 --group-size 2 (1000 worker processes) with Ray on this machine (--address local): it has"),
    Case("vectors pipeline beyond layers", "vectors", [*VEC, "--group-size", "3", "--split", "pipeline"], 2,
         "group size 3 is larger than the model's 2 layers", common=False, setup=_pairs),
    Case("vectors model-args split", "vectors", [*VEC, "--model-args", "split=tensor"], 2,
         "--model-args split=tensor: set it with --split", common=False),
    Case("sweep model group_size 0", "sweep", SWEEP, 1, "model.group_size: too small: give an integer >= 1", common=False,
         setup=lambda w, case: _sweep(w, case, model=", group_size: 0")),
    Case("sweep model split unknown", "sweep", SWEEP, 1, "model.split: unknown value (choose one of auto, pipeline, tensor), not 'ring'",
         common=False, setup=lambda w, case: _sweep(w, case, model=", split: ring")),
    Case("sweep pipeline beyond layers", "sweep", SWEEP, 1, "sweep.yaml: model: group size 4 is larger than the model's 2 layers", common=False,
         setup=lambda w, case: _sweep(w, case, model=", group_size: 4")),
    Case("sweep flag tensor heads", "sweep", [*SWEEP, "--group-size", "3", "--split", "tensor"], 2,
         "the model's 4 attention heads do not divide by group size 3", common=False, setup=_sweep),
    Case("demo group-size 0", "demo", ["--group-size", "0", "--dir", "{case}/out"], 2, "--group-size 0: too small", common=False),
]  # fmt: skip
CLUSTER_ROWS: list[Case] = [  # workers on this machine, staging, cluster commands
    Case("workers 1000 local", "run", ["--workers", "1000", "--address", "local"], 1,
         "--workers 1000 with Ray on this machine (--address local): "),
    Case("vectors workers 1000 local", "vectors", [*VEC[:4], "--workers", "1000", "--address", "local"], 1,
         "--workers 1000 with Ray on this machine (--address local): ", common=False, setup=_pairs),
]  # fmt: skip
ROWS = SETTINGS + PREFLIGHT + STEERING_ROWS + SWEEP_ROWS + MODEL_ROWS + GROUP_ROWS + CLUSTER_ROWS


def _argv(case: Case, w: World, folder: Path) -> list[str]:
    extra = case.setup(w, folder) if case.setup else []
    fill = [a.replace("{case}", str(folder)) for a in case.args]
    if case.command == "vectors":
        return ["vectors", "--model", str(w.model), *fill, *extra]
    if not case.common:
        return [case.command, *fill, *extra]
    common = {"--model": str(w.model), "--tasks": "orchard_mc", "--include-path": str(w.tasks), "--workers": "1",
              "--output-path": str(folder / "out")}  # fmt: skip
    given = set(fill) | set(extra)
    base = [x for k, v in common.items() if k not in given for x in (k, v)]
    return ["run", *base, *fill, *extra]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


# The table runs in this process (the real entry point, `driver.cli.main` in standalone mode, with each case's
# environment), but these cases need a fresh one: huggingface_hub reads HF_HOME and the offline switch when it is
# imported, and those cases point at a hub cache of their own.
FRESH_PROCESS = {"repo id offline, not cached", "repo id cached without weights"}


@pytest.fixture(scope="module")
def _no_ray_connection():
    """The table's commands connect to Ray themselves (an embedded one, or refuse an address), as in a new process."""
    with inproc.disconnected():
        yield


@pytest.mark.usefixtures("_no_ray_connection")
@pytest.mark.parametrize("case", ROWS, ids=lambda c: c.name.replace(" ", "-"))
def test_mistake_is_one_line_and_writes_nothing(case: Case, world: World):
    folder = world.tmp / case.name.replace(" ", "_").replace(",", "")
    folder.mkdir(parents=True, exist_ok=True)
    argv = _argv(case, world, folder)
    before = _snapshot(folder)
    if case.name == "output path read-only":
        try:
            with tempfile.TemporaryFile(dir="/sys"):
                pytest.skip("/sys is writable here")
        except OSError:
            pass
    run = driver if case.name in FRESH_PROCESS else in_process
    proc, seconds = run(*argv, env={**world.env, **case.env}, cwd=folder)
    TIMES.append(("settings" if case in SETTINGS else "preflight", case.name, proc.returncode, seconds))
    assert_one_line_error(proc, case.code, case.message)
    assert _snapshot(folder) == before, "a refused command changed files"  # nothing written, a bad cache untouched
    assert not (folder / "out").exists() and not Path("/sys/orchard-out").exists()


def test_help_is_quick(world: World):
    proc, seconds = driver("--help", env=world.env, cwd=world.tmp)
    TIMES.append(("help", "driver --help", proc.returncode, seconds))
    assert proc.returncode == 0 and "Usage:" in proc.stdout and proc.stderr == ""


# --- a real token-authenticated two-node cluster on loopback ------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# `ray start` for a second node on this machine: multi-node needs RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1, with which
# Ray rewrites the head's 127.0.0.1 into this machine's network address, where a loopback head does not listen.
# The same `ray start`, keeping 127.0.0.1 (every socket of the cluster stays on loopback: checked below).
_JOIN_LOOPBACK = (
    "import sys, ray._private.services as s; s.resolve_ip_for_localhost = lambda host: host; "
    "from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()"
)


def _ray(*args: str, env: dict[str, str], join_loopback: bool = False) -> None:
    command = [sys.executable, "-c", _JOIN_LOOPBACK] if join_loopback else [str(Path(sys.executable).with_name("ray"))]
    proc = subprocess.run([*command, *args], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def _listening(mark: str) -> list[str]:
    import psutil

    pids = {p.pid for p in _processes_under(mark)}
    return [c.laddr.ip for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN and c.pid in pids]


def _processes_under(mark: str) -> list:
    """Processes whose command line names `mark` (this cluster's temp folder), and their descendants."""
    import psutil

    found = set()
    for p in psutil.process_iter(["cmdline"]):
        try:
            if mark in " ".join(p.info["cmdline"] or []):
                found.add(p)
                found.update(p.children(recursive=True))
        except psutil.Error:
            pass
    return list(found)


def _stop(mark: str) -> None:
    """`ray stop`, limited to this cluster: `ray stop` itself ends every Ray process of the machine."""
    import psutil

    procs = _processes_under(mark)
    for p in procs:
        with _quiet():
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:
        with _quiet():
            p.kill()


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        import psutil

        return kind is not None and issubclass(kind, psutil.Error)


@dataclass
class Cluster:
    address: str
    token_file: Path
    env: dict[str, str]  # a driver's environment without the token
    root: Path  # its RAY_TMPDIR (session folders, ray_current_cluster)


def _hub_cache(hf_home: Path, model: Path, repo: str) -> None:
    """`repo` in a Hugging Face cache, as `hf download` leaves it (refs/main -> snapshots/<commit>)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    folder = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    shutil.copytree(model, folder / "snapshots" / commit)
    _file(folder / "refs" / "main", commit)


HUB_REPO = "orchard-test/tiny-llama"


def _start_cluster(root: Path, world: World) -> Cluster:
    """Head (mlx: 1) + one worker node (mlx: 1), token auth on. The head's Hugging Face cache has HUB_REPO; the
    worker node's is empty (and offline): a Hub model that cannot be fetched on one node."""
    home, worker_home = root / "h", root / "w"
    token = _file(root / "token", os.urandom(16).hex())
    env = {**base_env(home), "RAY_TMPDIR": str(root / "t")}
    (root / "t").mkdir(exist_ok=True)
    _hub_cache(home / "hf", world.model, HUB_REPO)
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    port = _free_port()
    common = ["--node-ip-address", "127.0.0.1", "--resources", '{"mlx": 1}', "--num-cpus", "1", "--disable-usage-stats"]
    _ray("start", "--head", "--port", str(port), "--include-dashboard", "false", *common, env={**env, **auth})
    worker_env = {**base_env(worker_home), "RAY_TMPDIR": str(root / "t"), **auth, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
    _ray("start", "--address", f"127.0.0.1:{port}", *common, env=worker_env, join_loopback=True)
    exposed = [ip for ip in _listening(str(root)) if ip.removeprefix("::ffff:") != "127.0.0.1"]
    assert not exposed, f"the test cluster listens beyond loopback: {exposed}"
    return Cluster(f"127.0.0.1:{port}", token, env, root)


@pytest.fixture(scope="module", autouse=True)
def _cluster_starting(request, world: World):
    """The cluster starts in the background as soon as this module does (its ~10 s overlap the table above);
    stopped at the end by killing exactly its processes."""
    box: dict = {}
    if not any("cluster" in item.fixturenames for item in request.session.items):
        yield box
        return
    root = Path(tempfile.mkdtemp(prefix="oc", dir="/tmp"))  # short: Ray's socket paths must stay < 108 bytes

    def start() -> None:
        try:
            box["cluster"] = _start_cluster(root, world)
        except BaseException as e:  # reported by the first test that needs the cluster
            box["error"] = e

    box["thread"] = threading.Thread(target=start, daemon=True)
    box["thread"].start()
    try:
        yield box
    finally:
        box["thread"].join(timeout=240)
        _stop(str(root))
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(_cluster_starting: dict) -> Cluster:
    _cluster_starting["thread"].join(timeout=240)
    if "error" in _cluster_starting:
        raise _cluster_starting["error"]
    return _cluster_starting["cluster"]


def _timed(group: str, name: str, *args, env, cwd, timeout: float = 240):
    proc, seconds = driver(*args, env=env, cwd=cwd, timeout=timeout)
    TIMES.append((group, name, proc.returncode, seconds))
    return proc


def test_cluster_wants_a_token_and_says_which_variable(cluster: Cluster, world: World):
    proc = _timed("cluster", "nodes without the token", "nodes", "--address", cluster.address, env=cluster.env, cwd=world.tmp)
    line = assert_one_line_error(proc, 1, f"the Ray cluster at {cluster.address} requires token authentication")
    assert "RAY_AUTH_MODE=token" in line and "RAY_AUTH_TOKEN" in line and "ray get-auth-token" in line
    wrong = _file(cluster.root / "wrong", "not-the-token")
    env = {**cluster.env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(wrong)}
    proc = _timed("cluster", "nodes with a wrong token", "nodes", "--address", cluster.address, env=env, cwd=world.tmp)
    assert_one_line_error(proc, 1, f"the Ray cluster at {cluster.address} rejects the token from RAY_AUTH_TOKEN_PATH={wrong}")
    env = {**cluster.env, "RAY_AUTH_MODE": "token"}
    proc = _timed("cluster", "nodes with mode but no token", "nodes", "--address", cluster.address, env=env, cwd=world.tmp)
    assert_one_line_error(proc, 1, "RAY_AUTH_MODE=token but this driver has no token")
    env = {**cluster.env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(cluster.root / "absent")}
    proc = _timed("cluster", "token path names no file", "nodes", "--address", cluster.address, env=env, cwd=world.tmp)
    assert_one_line_error(proc, 1, "RAY_AUTH_TOKEN_PATH=")


def test_cluster_with_the_token_lists_both_nodes(cluster: Cluster, world: World):
    env = {**cluster.env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": cluster.token_file.read_text()}
    proc = _timed("cluster", "nodes with the token (ok)", "nodes", "--address", cluster.address, env=env, cwd=world.tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(proc.stdout.strip().splitlines()) == 2 and "Traceback" not in proc.stderr


def test_a_loopback_cluster_that_ray_would_dial_elsewhere_is_one_line(cluster: Cluster, world: World):
    """With RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1 (the CLI's default), Ray dials 127.0.0.1 as this machine's network
    address, where a loopback-only head does not listen: ray.init would retry for minutes."""
    env = {**cluster.env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(cluster.token_file)}
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1"
    proc = _timed("cluster", "loopback head, dialed elsewhere", "nodes", "--address", cluster.address, env=env, cwd=world.tmp)
    if proc.returncode == 0:
        pytest.skip("this machine has no network address other than loopback: Ray dials 127.0.0.1 as is")
    assert_one_line_error(proc, 1, "set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0")


def test_address_auto_is_the_ray_start_cluster_only(cluster: Cluster, world: World):
    """auto: the cluster `ray start` recorded under RAY_TMPDIR, with the token Ray would send for it (a local
    ~/.ray/auth_token); with another RAY_TMPDIR the same running cluster is not picked up."""
    home = Path(cluster.env["HOME"])
    _file(home / ".ray" / "auth_token", cluster.token_file.read_text())
    try:
        proc = _timed("cluster", "nodes --address auto (ok)", "nodes", "--address", "auto", env=cluster.env, cwd=world.tmp)
        assert proc.returncode == 0 and len(proc.stdout.strip().splitlines()) == 2, proc.stderr[-3000:]
    finally:
        (home / ".ray" / "auth_token").unlink()
    other = {**cluster.env, "RAY_TMPDIR": str(world.tmp)}
    proc = _timed("cluster", "auto: not another's session", "nodes", "--address", "auto", env=other, cwd=world.tmp)
    assert_one_line_error(proc, 1, "--address auto: no Ray cluster was started with `ray start` on this machine")


def test_a_hub_model_missing_on_a_worker_node_names_that_node(cluster: Cluster, world: World):
    """The head has the repo in its Hugging Face cache (the pre-flight passes), the worker node does not and is
    offline. (`driver vectors` starts workers exactly as `driver run` does, without lm-eval's task index first.)"""
    env = {**cluster.env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(cluster.token_file)}
    folder = world.tmp / "hub-run"
    _pairs(world, folder)
    out = folder / "v.safetensors"
    proc = _timed(
        "worker", "Hub id not on a worker node", "vectors", "--model", HUB_REPO, "--pairs", folder / "pairs.jsonl",
        "--out", out, "--workers", "all", "--address", cluster.address, env=env, cwd=world.tmp,
    )  # fmt: skip
    line = assert_one_line_error(proc, 1, "cannot load the model: cannot fetch 'orchard-test/tiny-llama' from the Hugging Face Hub")
    assert re.search(r"worker w\d on \S+ \(127\.0\.0\.1, node [0-9a-f]{8}\) cannot load", line), line
    assert "download it there" in line
    assert not out.exists()


def test_groups_the_cluster_cannot_hold_are_one_line_before_loading(cluster: Cluster, world: World):
    """N groups of K need N*K `mlx` nodes, and a group K distinct ones: the two-node cluster refuses 2 groups of 2
    and a group of 3 (the stories model: 5 layers, so a 3-stage pipeline is otherwise fine) in one line."""
    from testbed.stories import MODEL

    env = {**cluster.env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(cluster.token_file)}
    folder = world.tmp / "groups-cluster"
    _pairs(world, folder)
    out = folder / "v.safetensors"
    cases = [(world.model, ["--workers", "2", "--group-size", "2"], "--workers 2 --group-size 2 needs 4 `mlx` nodes but the cluster has 2"),
             (MODEL, ["--workers", "1", "--group-size", "3"], "--group-size 3 needs 3 `mlx` nodes but the cluster has 2")]  # fmt: skip
    for model, args, message in cases:
        proc = _timed("cluster", f"groups {' '.join(args[1::2])}", "vectors", "--model", model, "--pairs", folder / "pairs.jsonl",
                      "--out", out, "--address", cluster.address, *args, env=env, cwd=world.tmp)  # fmt: skip
        assert_one_line_error(proc, 1, message)
        assert not out.exists()


def _worker_pids(root: Path) -> list[int]:
    return [p.pid for p in _processes_under(str(root)) if "WorkerActor" in " ".join(_cmdline(p))]


def _cmdline(p) -> list[str]:
    try:
        return p.cmdline()
    except Exception:
        return []


def test_workers_lost_mid_run_are_named_and_finished_work_stays_cached(cluster: Cluster, world: World):
    """Both workers killed (SIGKILL, by pid) once the first results are cached, with restarts off: one line names
    each lost worker, its node and what Ray saw; what finished is in the cache. (`driver vectors` with a result
    cache: the same executor and error path as `driver run`, without lm-eval's index first.)"""
    env = {**cluster.env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(cluster.token_file)}
    folder = world.tmp / "lost-run"
    words = "the little dog was happy and played all day in the warm sun with the boy".split()
    lines = [json.dumps({"positive": " ".join(words[i % 5:] * 3), "negative": " ".join(words[: 5 + i % 7] * 3)}) for i in range(400)]
    pairs = _file(folder / "pairs.jsonl", "\n".join(lines) + "\n")
    cache = folder / "cache" / "results.sqlite"
    argv = [sys.executable, "-m", "driver", "vectors", "--model", str(world.model), "--pairs", str(pairs), "--out",
            str(folder / "v.safetensors"), "--workers", "all", "--address", cluster.address,
            "--model-args", f"max_restarts=0,max_batch_tokens=32,batch_size=1,cache={folder / 'cache'}"]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, cwd=world.tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed: list[int] = []
    try:
        until(lambda: proc.poll() is not None or (cache.exists() and _rows(cache) > 0), 180, 0.02)
        killed = _worker_pids(cluster.root)
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    TIMES.append(("worker", "workers lost mid-run", proc.returncode, time.perf_counter() - start))
    assert killed, "no worker process found to kill"
    # The run had started: progress bars and Ray's own "(raylet) A worker died" notices (stderr) come first;
    # the error is the one `Error:` line, and the last.
    assert "Traceback" not in stdout + stderr and proc.returncode == 1, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and stderr.strip().splitlines()[-1] == errors[0], stderr[-3000:]
    line = errors[0]
    assert re.search(r"every worker is lost \(w\d on \S+ \(127\.0\.0\.1, node [0-9a-f]{8}\) died \(", line), line
    assert "capture requests finished; they are cached in" in line and "rerun the same command to resume" in line, line
    assert 0 < _rows(cache) < 800 and not (folder / "v.safetensors").exists()  # finished work stays, nothing half-written


def _rows(path: Path) -> int:
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            return db.execute("SELECT COUNT(*) FROM results").fetchone()[0]
    except sqlite3.Error:
        return 0


def test_a_worker_killed_for_memory_while_loading_is_one_line(world: World):
    """Ray's memory monitor, told that 1% of memory is too much, kills each worker as it loads (a real
    OutOfMemoryError, as a model too large for its node gets)."""
    env = {**world.env, "RAY_memory_usage_threshold": "0.01", "RAY_memory_monitor_refresh_ms": "50"}
    folder = world.tmp / "oom-run"
    _pairs(world, folder)
    out = folder / "v.safetensors"
    proc = _timed(
        "worker", "killed for memory at start", "vectors", "--model", world.model, "--pairs", folder / "pairs.jsonl",
        "--out", out, "--workers", "1", "--address", "local", "--threads", "1", env=env, cwd=world.tmp,
    )  # fmt: skip
    line = assert_one_line_error(proc, 1, "was killed by Ray for running out of memory while loading")
    assert re.search(r"worker w0 on \S+ \(127\.0\.0\.1, node [0-9a-f]{8}\) was killed", line), line
    assert "RAY_memory_usage_threshold" in line, line
    assert not out.exists()


def test_a_tasks_dataset_missing_offline_is_one_line(world: World):
    """Found before Ray from the task's YAML (driver.checks.datasets), said in one line."""
    folder = world.tmp / "dataset_offline"
    _file(folder / "yamls" / "hubtask.yaml", "task: orchard_hub_task\ndataset_path: orchard-test/not-cached\n"
          "output_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{q}}'\ndoc_to_target: 0\ndoc_to_choice: ['a', 'b']\n")  # fmt: skip
    proc, _ = driver("run", "--model", world.model, "--tasks", "orchard_hub_task", "--include-path", folder / "yamls",
                     "--workers", "1", "--output-path", folder / "out", env=world.env, cwd=folder)  # fmt: skip
    line = assert_one_line_error(proc, 1, "--tasks: task orchard_hub_task's dataset orchard-test/not-cached is not in the datasets cache")
    assert "HF_DATASETS_CACHE" in line and "starting Ray" not in proc.stderr
    assert not (folder / "out").exists() or not any((folder / "out").rglob("results_*.json"))
