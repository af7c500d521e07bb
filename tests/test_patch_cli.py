"""`driver patch` end to end (issue 37, the driver's side): the file and its pairs refused in one line before any
worker, the numbers equal on 1 and 2 workers and equal to the kernel run pair by pair in this process, patching
invariants that need no kernel (a position whose tokens agree recovers nothing, the one that differs everything at
the embeddings, the final residual everything), the cache resuming and growing a grid cell by cell."""

from __future__ import annotations

import csv
import json
import shutil
import sqlite3
from pathlib import Path

import pytest

from testbed.inproc import driver, session_address

TEMPLATE = "Lily had a red {}. Lily loved her red"
PAIRS = [  # one template (15 tokens with the BOS); the objects' first tokens differ, the model predicts each clean one
    {"clean": TEMPLATE.format("ball"), "corrupt": TEMPLATE.format("cat"), "correct": " ball", "wrong": " cat"},
    {"clean": TEMPLATE.format("toy"), "corrupt": TEMPLATE.format("hat"), "correct": " toy", "wrong": " hat"},
    {"clean": TEMPLATE.format("car"), "corrupt": TEMPLATE.format("ball"), "correct": " car", "wrong": " ball"},
    # one token differs (position 1, the name): at layer 0 it alone carries the whole difference
    {"clean": TEMPLATE.format("ball"), "corrupt": "Tim had a red ball. Lily loved her red", "correct": " ball", "wrong": " cat"},
]
GRID = "sites: [resid_pre, resid_post, attn_head]\nlayers: [0, 4]\npositions: all\nmethod: [exact, attribution]\n"


def write_study(folder: Path, model: Path, grid: str = GRID, pairs=PAIRS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    (folder / "study.yaml").write_text(f"model: {{pretrained: {model}}}\npairs: pairs.jsonl\n{grid}")
    return folder / "study.yaml"


def patch_cli(study: Path, *args, address: str | None = None):
    return driver("patch", study, "--address", address or session_address(), *args, cwd=study.parent, env={"HF_HUB_OFFLINE": "1"})


def read_rows(folder: Path) -> dict[tuple, dict]:
    with open(folder / "results.csv", newline="") as f:
        return {(r["site"], r["layer"], r["position"], r["head"], r["method"], r["metric"]): r for r in csv.DictReader(f)}


# --- refused in one line, before any worker (the address cannot be reached: nothing got that far) ---------------------


def _lines(*pairs: dict) -> list[dict]:
    return [PAIRS[0], *pairs]


REFUSALS = [
    (GRID, _lines({**PAIRS[0], "corrupt": TEMPLATE.format("kite")}), (),
     "pairs.jsonl: line 2: the clean prompt is 15 tokens and the corrupt one 16: a pair must tokenize to the same length"),
    (GRID, _lines({**PAIRS[0], "corrupt": PAIRS[0]["clean"]}), (), "pairs.jsonl: line 2: the clean and corrupt prompts are the same tokens"),
    (GRID, _lines({**PAIRS[2], "wrong": " cat"}), (), "pairs.jsonl: line 2: 'correct' ' car' and 'wrong' ' cat' start with the same token"),
    (GRID, _lines({"clean": "Lily had a dog.", "corrupt": "Lily had a cat.", "correct": " x", "wrong": " y"}), (),
     "pairs.jsonl: line 2: its prompts are 7 tokens where line 1's are 15: patching by position needs every pair of one length"),
    (GRID, _lines({"clean": "a", "corrupt": "b", "correct": " x"}), (), "pairs.jsonl: line 2: missing field 'wrong'"),
    ("layers: [0, 5]\n", PAIRS, (), "study.yaml: layers: 5 is out of range: the model has 5 layers (use 0..4 or -5..-1 from the end)"),
    ("positions: [-16]\n", PAIRS, (), "study.yaml: positions: -16 is out of range: every pair has 15 tokens (use 0..14 or -15..-1"),
    ("sites: attn_head\nheads: [8]\n", PAIRS, (), "study.yaml: heads: 8 is out of range: the model has 8 attention heads (use 0..7)"),
    ("sites: [resid_pre, resid_foo]\n", PAIRS, (), "study.yaml: sites[1]: 'resid_foo' is not allowed"),
    ("methods: exact\n", PAIRS, (), "study.yaml: methods: unknown field (did you mean 'method'?"),
    ("layers: [1, -4]\n", PAIRS, (), "study.yaml: layers: -4 is 1, which is already listed"),
]


@pytest.mark.parametrize(("grid", "pairs", "flags", "message"), REFUSALS)
def test_a_bad_file_or_pair_is_refused_in_one_line_before_any_worker(stories_path, tmp_path, grid, pairs, flags, message):
    study = write_study(tmp_path / "study", stories_path, grid, pairs)
    done = patch_cli(study, "--workers", "1", "--output", tmp_path / "out", *flags, address="127.0.0.1:1")
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert done.returncode == 1 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert message in errors[0], errors[0]
    assert not (tmp_path / "out").exists()


def test_a_site_the_family_lacks_and_heads_on_a_tensor_group_are_refused_before_any_worker(stories_path, tmp_path):
    model = tmp_path / "parallel"
    shutil.copytree(stories_path, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "cohere"}))
    study = write_study(tmp_path / "study", model, "sites: [attn_out, resid_mid]\n")
    done = patch_cli(study, "--workers", "1", "--output", tmp_path / "out", address="127.0.0.1:1")
    assert done.returncode == 1 and done.stderr.count("Error:") == 1, done.stderr
    assert "study.yaml: sites: resid_mid: the cohere block runs attention and MLP in parallel" in done.stderr
    study = write_study(tmp_path / "study2", stories_path)
    done = patch_cli(study, "--workers", "1", "--group-size", "2", "--split", "tensor", "--output", tmp_path / "out", address="local")
    assert done.returncode == 2 and "Error: attn_head cells cannot run on a tensor-split group" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def test_the_plan_resolves_layers_positions_and_heads_and_keeps_each_pairs_cells_together(stories_path, tmp_path):
    from driver.patch import load_patch

    grid = "sites: [attn_out, attn_head]\nlayers: [-1, 1]\npositions: [last, 0]\nheads: [7, 0]\nmethod: [attribution, exact]\n"
    with pytest.raises(Exception, match="positions"):  # `last` is a word of its own, not a list item
        load_patch(write_study(tmp_path / "bad", stories_path, grid))
    plan = load_patch(write_study(tmp_path / "study", stories_path, grid.replace("[last, 0]", "[-1, 0]")))
    cells = [(c.method, c.site, c.layer, c.position, c.head) for c in plan.cells]
    assert cells[:4] == [("attribution", "attn_out", 4, 14, None), ("attribution", "attn_out", 4, 0, None),
                         ("attribution", "attn_out", 1, 14, None), ("attribution", "attn_out", 1, 0, None)]  # fmt: skip
    assert cells[4:8] == [("attribution", "attn_head", 4, None, 7), ("attribution", "attn_head", 4, None, 0),
                          ("attribution", "attn_head", 1, None, 7), ("attribution", "attn_head", 1, None, 0)]  # fmt: skip
    assert len(cells) == 16 and cells[8:] == [("exact", *c[1:]) for c in cells[:8]]
    last = load_patch(write_study(tmp_path / "last", stories_path, "positions: last\n"))
    assert {c.position for c in last.cells} == {14} and {c.layer for c in last.cells} == set(range(5))
    requests = plan.requests()
    assert [r.clean for r in requests] == [p.clean_ids for p in plan.pairs for _ in plan.cells]  # a pair's cells contiguous
    assert plan.labels[6:8] == ["b/c", "all/at"] and plan.labels[1] == "Lily"


class _Executor:
    """Pure logic: answers the first pass with the given logit differences, records what it was asked."""

    def __init__(self, lds):
        self.lds, self.asked = lds, []

    def run(self, job, requests):
        self.asked.append(len(requests))
        return [(corrupt, clean, corrupt) for clean, corrupt in self.lds]

    def info(self):
        return {}


def test_equal_clean_and_corrupt_logit_differences_are_refused_naming_the_line_before_the_grid(stories_path, tmp_path):
    from driver.patch import PatchError, load_patch, run_on

    plan = load_patch(write_study(tmp_path / "study", stories_path, "sites: attn_head\n"))
    executor = _Executor([(1.5, -0.5), (2.0, 2.0 + 1e-9), (0.1, 0.3), (3.0, 3.0)])
    with pytest.raises(PatchError, match=r"pairs.jsonl: line 2: the clean and corrupt prompts give the same logit difference "
                                         r"\(2\)  ?\(so do lines 4\), so `recovered` would divide by zero") as e:  # fmt: skip
        run_on(executor, plan, echo=lambda line: None)
    assert "\n" not in str(e.value) and executor.asked == [4]  # the grid never ran


# --- the numbers -------------------------------------------------------------------------------------------------


def _kernel_rows(stories_path: Path, plan) -> dict[tuple, float]:
    """Mean logit_diff and recovered per cell, from the kernel run pair by pair in this process (one worker)."""
    import numpy as np

    from worker.load import load
    from worker.patch import run
    from worker.patch.spec import PatchRequest
    from worker.spec import ModelSpec

    lm = load(ModelSpec(model=str(stories_path)))
    out: dict[tuple, list] = {}
    for pair in plan.pairs:
        requests = [PatchRequest(clean=pair.clean_ids, corrupt=pair.corrupt_ids, correct=pair.correct_id, wrong=pair.wrong_id, cell=c)
                    for c in plan.cells]  # fmt: skip
        for cell, (value, clean, corrupt) in zip(plan.cells, run(lm, requests)):
            key = (cell.site, str(cell.layer), "" if cell.position is None else str(cell.position), "" if cell.head is None else str(cell.head), cell.method)
            out.setdefault(key + ("logit_diff",), []).append(value)
            out.setdefault(key + ("recovered",), []).append((value - corrupt) / (clean - corrupt))
    return {k: float(np.mean(v)) for k, v in out.items()}


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory, stories_path, ray_cluster) -> tuple[Path, Path]:
    """The study on one worker of the session's cluster: (its file, its output folder), shared by the tests below."""
    folder = tmp_path_factory.mktemp("patch")
    study = write_study(folder / "study", stories_path)
    done = patch_cli(study, "--workers", "1", "--output", folder / "w1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "152 cells x 4 pairs on 1 worker" in done.stdout and "608 computed" in done.stdout, done.stdout
    return study, folder / "w1"


def test_one_and_two_workers_equal_the_kernel_pair_by_pair_and_the_invariants(stories_path, tmp_path, one_worker):
    from driver.patch import load_patch

    study, w1 = one_worker
    done = patch_cli(study, "--workers", "2", "--output", tmp_path / "w2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "152 cells x 4 pairs on 2 workers" in done.stdout and "608 computed" in done.stdout, done.stdout
    runs = {1: read_rows(w1), 2: read_rows(tmp_path / "w2")}
    per_worker = json.loads((tmp_path / "w2" / "run.json").read_text())["run"]["per_worker"]
    assert len(per_worker) == 2 and all(w["requests"] > 0 for w in per_worker.values()), per_worker  # both computed cells
    assert runs[1].keys() == runs[2].keys() and len(runs[1]) == 2 * 152
    assert max(abs(float(runs[1][k]["value"]) - float(runs[2][k]["value"])) for k in runs[1]) <= 1e-6
    kernel = _kernel_rows(stories_path, load_patch(study))
    assert kernel.keys() == runs[1].keys()
    assert max(abs(float(runs[2][k]["value"]) - v) for k, v in kernel.items()) <= 1e-4  # the bound (float32 batches)
    recovered = {k[:5]: float(r["value"]) for k, r in runs[2].items() if k[5] == "recovered"}
    differ = {1, 6, 7}  # the name pair differs at position 1 only, the object pairs at 6 and 7
    for method in ("exact", "attribution"):  # where every pair's tokens agree, layer 0 holds no difference (float32 noise)
        zeros = [recovered[("resid_pre", "0", str(p), "", method)] for p in range(15) if p not in differ]
        assert max(map(abs, zeros)) <= 1e-5, zeros
    assert abs(recovered[("resid_pre", "0", "1", "", "exact")] - 0.25) <= 1e-5  # the name pair's 1 (its only difference), 3 x 0
    assert abs(recovered[("resid_post", "4", "14", "", "exact")] - 1.0) <= 1e-5  # the final residual: the clean run's logits
    pairs = [json.loads(line) for line in (tmp_path / "w2" / "pairs.jsonl").read_text().splitlines()]
    assert [p["line"] for p in pairs] == [1, 2, 3, 4] and len(pairs[0]["clean_tokens"]) == 15
    assert all(p["clean_logit_diff"] > 0 > p["corrupt_logit_diff"] for p in pairs[:3])  # the model copies each object
    assert sorted(p.name for p in (tmp_path / "w2" / "plots").iterdir()) == ["patch-attn_head.png", "patch-resid_post.png", "patch-resid_pre.png"]
    assert "## Top 10 components by |recovered|" in (tmp_path / "w2" / "summary.md").read_text()


# --- the cache: a grown grid, an interrupted run ------------------------------------------------------------------


def test_a_grown_grid_and_an_interrupted_run_compute_only_the_missing_cells(stories_path, tmp_path, one_worker):
    out = tmp_path / "out"
    shutil.copytree(one_worker[1], out)  # its cache holds layers 0 and 4 of every cell
    first = read_rows(out)
    with sqlite3.connect(out / "cache" / "results.sqlite") as db:  # as if interrupted: its last chunk's cells never landed
        db.execute("DELETE FROM results WHERE rowid IN (SELECT rowid FROM results ORDER BY rowid DESC LIMIT 7)")
    grown = write_study(tmp_path / "study", stories_path, GRID.replace("[0, 4]", "[0, 2, 4]"))
    done = patch_cli(grown, "--workers", "1", "--output", out)
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads((out / "run.json").read_text())["run"]
    assert (run["cells_computed"], run["cells_cached"]) == (4 * 76 + 7, 4 * 152 - 7)  # layer 2's cells and the 7 lost ones
    assert all(read_rows(out)[k] == v for k, v in first.items())  # the same numbers, cached or computed again
