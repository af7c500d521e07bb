"""The pipeline group's planted slips no test caught (issue 38.8), on one REAL mx.distributed ring of 2 local
processes (testbed.ring, no Ray):

- a row whose sampled id is 0 goes on decoding (worker.split.decode._Micro.advance: only DONE/POISONED, which are
  negative, finish a row; in GPT-2/Qwen/Llama-3 vocabularies id 0 is "!"): the texts equal the unsplit model's;
- a generation grid's prefix KVs stored for later jobs (worker.grid.pipelined.family_prefixes): a configuration
  alike on rank 0's layers to a steered one (not to the unsteered one) is stored there with that one's KV, and a
  later job steered as it finds it in the store and generates the unsplit model's texts.
A random llama of 4 layers and 300 tokens (id 0 is <unk> there: decoded as nothing, the row's later tokens are
what tells)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from test_pipeline_grid import _family_prompts
from testbed.models import write_model
from testbed.ring import run_split
from worker.generate import GenRequest, generate_tokens
from worker.jobs import run
from worker.load import load
from worker.spec import Batching, Grouping, Intervention, Job, Steering
from worker.split.plan import pipeline_ranges


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("probe4ring") / "llama", layers=4, vocab_size=300)


def _sampled(seed: int) -> GenRequest:
    context = tuple(np.random.default_rng(seed).integers(3, 250, 1 + seed % 7).tolist())
    return GenRequest(context=context, max_gen_toks=16, do_sample=True, temperature=2.0, top_k=0, seed=seed)


def _with_zero(lm) -> list[GenRequest]:
    """Sampled rows, the first three of which draw id 0 before their last token (found by trying seeds: the same
    ones every run), then five that do not."""
    tries = [_sampled(seed) for seed in range(96)]
    ids = generate_tokens(lm, tries, batch_size=32)
    zero = [r for r, t in zip(tries, ids) if 0 in t[:-1]]
    other = [r for r, t in zip(tries, ids) if 0 not in t]
    assert len(zero) >= 3, "no row drew id 0: the test would prove nothing"
    return zero[:3] + other[:5]


def _iv(layer: int, seed: int) -> Intervention:
    return Intervention(layer=layer, vector=tuple(np.random.default_rng(seed).standard_normal(64).tolist()), alpha=3.0)


def _grid(config: dict) -> tuple[Steering, ...]:
    """Unsteered; rank 0's first layer; the same and the last rank's first layer (alike on rank 0's layers to the
    second configuration, not to the first)."""
    (first, _), (last, _) = pipeline_ranges(config, 2)
    return (Steering(), Steering(interventions=(_iv(first, 1),)), Steering(interventions=(_iv(first, 1), _iv(last, 2))))


@pytest.fixture(scope="module")
def work(model):
    lm = load(str(model))
    grid = _grid(json.loads((model / "config.json").read_text()))
    family = _family_prompts(False)
    return [("zero", Job(kind="generate"), _with_zero(lm), Batching(batch_size=3)),
            ("grid", Job(kind="generate", grid=grid), family, Batching()),
            ("stored", Job(kind="generate", steering=grid[2]), family, Batching())]  # fmt: skip


@pytest.fixture(scope="module")
def ring(model, work):
    reports = run_split({"m": model}, Grouping(size=2, split="pipeline"), [("m", *w[1:]) for w in work], timeout=300)
    return [dict(zip([w[0] for w in work], zip(r["results"], r["lookups"]))) for r in reports]


def test_a_row_that_draws_id_0_goes_on_as_on_one_worker(model, work, ring):
    _, job, reqs, batching = work[0]
    want = list(run(load(str(model)), job, reqs, batching))
    assert ring[-1]["zero"][0] == want
    assert all(want[:3])  # the rows drew more after their 0


def test_a_job_reads_the_prefix_a_grid_stored_on_each_rank(model, work, ring):
    """Each configuration run alone on a fresh unsplit model is the reference; the ring's last job found both
    families' prefixes in every rank's store (the grid put them there)."""
    _, grid_job, family, batching = work[1]
    fresh = [list(run(load(str(model)), Job(kind="generate", steering=s), family, batching)) for s in grid_job.grid]
    assert ring[-1]["grid"][0] == [list(row) for row in zip(*fresh)]
    assert ring[-1]["stored"][0] == fresh[2] != fresh[1]
    assert all(report["stored"][1][0] == 2 for report in ring)  # (hits, extended, misses): both prefixes found


# --- the ring tests' deadline: a hang fails in minutes (testbed.ring's stall watch) --------------------------------


def _procs(tmp_path, *codes: str):
    import sys

    from testbed.ring import _start

    logs = [tmp_path / f"rank{r}.log" for r in range(len(codes))]
    return [_start([sys.executable, "-c", code], log) for code, log in zip(codes, logs)], logs


def test_a_ring_where_no_rank_finishes_a_step_is_stopped(tmp_path):
    from testbed.ring import _wait

    procs, logs = _procs(tmp_path, "print('\\nstep', flush=True); import time; time.sleep(600)", "import time; time.sleep(600)")
    with pytest.raises(RuntimeError, match=r"ring stopped: no rank finished a step in 1 s \(steps done per rank: \[1, 0\]\)"):
        _wait(procs, logs, timeout=600, stall=1.0)
    assert [p.returncode for p in procs] == [-9, -9]  # both stopped


def test_a_failed_rank_stops_its_waiting_peers_at_once(tmp_path):
    from testbed.ring import _wait

    procs, logs = _procs(tmp_path, "import time; time.sleep(600)", "raise SystemExit('rank 1 broke')")
    with pytest.raises(RuntimeError, match=r"rank 1 exited 1: rank 1 broke"):
        _wait(procs, logs, timeout=600, stall=600)
    assert procs[0].returncode == -9
