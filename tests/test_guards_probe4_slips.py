"""Tests for the planted slips no test caught (issue 38.8), each one a test that the slip fails:

- a condition read at several layers from a vector file holding one key per layer (what `driver vectors` writes)
  reads its first layer's key (the input of the first layer it pools), not another layer's;
- an lm-eval CSV with two head_index rows at one hookpoint is two head interventions (the head is in the
  duplicate key), while the same head twice is refused;
- lm-eval's `repeats` (k equal requests, pass@k) through OrchardLM.generate_until: k different samples, each its
  occurrence's (the occurrence is in each request's seed);
- two conditional interventions listed against the order of their steered layers share a grown prefix as in layer
  order (worker.hooks.condition_share.grown_prefix: each decision's bit is its own, not its rank in layer order).
The pipeline group's slips (decode's sampled id 0, the grid's stored prefixes) are in test_guards_probe4_ring.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from safetensors.numpy import save_file

from driver.steering.lmeval_csv import read_csv
from driver.steering.spec import SteeringError, for_model
from test_steer_condition_share import _two, contexts, thresholds  # noqa: F401  fixtures
from test_steer_condition import direction, lm  # noqa: F401  fixtures
from worker.jobs import run
from worker.spec import Batching, Job, Steering

CONFIG = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 8, "num_attention_heads": 2}


def test_a_condition_over_several_layers_reads_its_first_layer_s_key(tmp_path):
    rng = np.random.default_rng(0)
    keys = {f"resid_pre.{layer}": rng.standard_normal(8).astype(np.float32) for layer in range(4)}
    save_file(keys, str(tmp_path / "v.safetensors"))  # one key per layer, as `driver vectors` writes them
    np.save(tmp_path / "s.npy", np.ones(8, np.float32))
    for layers in ([1, 2, 3], [2, 1]):
        spec = {"interventions": [{"layer": 3, "vector": "s.npy", "alpha": 1.0,
                                   "condition": {"vector": {"file": "v.safetensors"}, "layers": layers, "threshold": 0.1}}]}  # fmt: skip
        gate = for_model(spec, CONFIG, base_dir=tmp_path).steering.interventions[0].condition
        assert np.array_equal(np.asarray(gate.conditions[0].vector, np.float32), keys[f"resid_pre.{layers[0]}"])


HEADER = "loader,action,sparse_model,hookpoint,feature_index,steering_coefficient,head_index,sae_id,description\n"


def test_two_heads_at_one_hookpoint_are_two_interventions_and_one_head_twice_is_refused(tmp_path):
    (tmp_path / "heads.csv").write_text(HEADER + "sparsify,add,saes,layers.1.self_attn,3,2.0,0,,\n"
                                        "sparsify,add,saes,layers.1.self_attn,5,-1.0,1,,\n")  # fmt: skip
    spec, lines, _ = read_csv(tmp_path / "heads.csv")
    assert [(iv["site"], iv["layer"], iv["head"]) for iv in spec["interventions"]] == [("attn_head", 1, 0), ("attn_head", 1, 1)]
    assert lines == [2, 3]
    (tmp_path / "twice.csv").write_text(HEADER + "sparsify,add,saes,layers.1.self_attn,3,2.0,1,,\n"
                                        "sparsify,add,saes,layers.1.self_attn,5,-1.0,1,,\n")  # fmt: skip
    with pytest.raises(SteeringError, match=r"twice.csv: line 3: hookpoint: steers the same place as line 2"):
        read_csv(tmp_path / "twice.csv")


SAMPLED = {"do_sample": True, "temperature": 1.5, "top_k": 0, "max_gen_toks": 10, "until": ["\n\n"]}


@pytest.fixture(scope="module")
def orchard_lm(llama_path):
    from driver.lm.mlx import MLXLM

    return MLXLM(pretrained=str(llama_path), batch_size=4)


def test_repeats_of_one_request_draw_k_samples(orchard_lm):
    """lm-eval hands a task's `repeats: 4` to the model as the same request four times."""
    lm, k = orchard_lm, 4
    got = lm.generate_until([SimpleNamespace(args=("Once upon a time", dict(SAMPLED)))] * k)
    assert len(set(got)) >= 3  # 10 tokens at temperature 1.5 on random weights: equal only by a bug
    each = [lm.generate_until([SimpleNamespace(args=("Once upon a time", dict(SAMPLED)))] * (n + 1))[-1] for n in range(k)]
    assert got == each  # the n-th repeat draws the same sample in any batch
    seeds = {lm.generation_request("Once upon a time", SAMPLED, n, lm.sampling_seed).seed for n in range(k)}
    assert len(seeds) == k


def test_conditions_listed_against_layer_order_share_a_prefix_as_in_layer_order(lm, direction, thresholds):  # noqa: F811
    """B (steering layer 4) listed before A (layer 2): every row's decisions as in layer order, its numbers as
    running each row's whole prompt."""
    from test_steer_condition_share import WHOLE
    from test_steer_condition import ids

    ta, tb, fired = thresholds
    reqs = [(c, ids(lm, " The end.")) for c in contexts(lm)]
    ordered = _two(direction, ta, tb)
    backwards = Job(kind="loglikelihood", steering=Steering(interventions=ordered.interventions[::-1]))
    whole, shared = run(lm, backwards, reqs, WHOLE), run(lm, backwards, reqs, Batching(batch_size=6))
    assert [s[2] for s in shared] == [w[2] for w in whole] == fired  # fired: each row's decisions in layer order
    for w, s in zip(whole, shared):
        assert abs(s[0] - w[0]) <= 1e-5 and s[1] == w[1]
