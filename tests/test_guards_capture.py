"""Guard for capture on a pipeline group (worker.capture.pipelined_capture): the rows that ride forward to the last
rank start as zeros of the points' width (attn_head: heads*head_dim), not the hidden width, so each rank's rows fit
them. Fails on the slip that sized them by the hidden width.

A real ring of 2 processes (testbed.ring) on a random llama whose heads*head_dim (4*8 = 32) differs from its hidden
width (64): attn_head points on both ranks' layers, compared with the unsplit capture.
"""

from __future__ import annotations

import json

import numpy as np
from safetensors.numpy import load_file, save_file

from testbed.ring import run_split
from worker.jobs import run
from worker.load import load
from worker.spec import Batching, Grouping, Job

HEAD_DIM = 8


def _narrow_heads(folder):
    """The llama's attention cut to head_dim 8 (q/k/v rows, o_proj columns), `head_dim` named in its config."""
    config = json.loads((folder / "config.json").read_text())
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    weights = load_file(str(folder / "model.safetensors"))
    for name, w in list(weights.items()):
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            n = heads if "q_proj" in name else kv
            weights[name] = np.ascontiguousarray(w[: n * HEAD_DIM])
        elif name.endswith("o_proj.weight"):
            weights[name] = np.ascontiguousarray(w[:, : heads * HEAD_DIM])
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**config, "head_dim": HEAD_DIM}, indent=2))
    return folder


def test_head_capture_on_a_pipeline_group_equals_the_unsplit_capture(tmp_path):
    from testbed.models import write_model

    folder = _narrow_heads(write_model(tmp_path / "narrow", arch="llama", layers=2, heads=4, kv_heads=2))
    job = Job(kind="capture", points=("attn_head.0", "attn_head.1"))  # layer 0 on rank 0, layer 1 on rank 1
    requests = [([1, 5, 9, 20], -1), ([1, 7, 8, 30, 31], 2)]
    want = list(run(load(str(folder)), job, requests, Batching()))
    assert want[0].shape == (2, 4 * HEAD_DIM)
    reports = run_split({"narrow": folder}, Grouping(size=2, split="pipeline"), [("narrow", job, requests)], timeout=300)
    got = reports[-1]["results"][0]  # the last rank answers (worker.split.plan.answering_rank)
    assert not isinstance(got, str), got
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and np.abs(g - w).max() <= 1e-5 * max(1.0, float(np.abs(w).max()))
    assert reports[0]["results"][0] == [None] * len(requests)
