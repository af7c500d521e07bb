"""The result cache: keys depend on what decides a number and nothing else; rows survive a reopen."""

from __future__ import annotations

import pytest

from driver.cache import Cache, identity, job_prefix, key
from worker.generate import GenRequest
from worker.spec import Intervention, Job, Steering

MODEL = {"model": "org/m", "revision": None, "adapter": None, "files": "abc", "dtype": None, "max_length": 2048}


def steer(alpha=1.0, vector=(1.0, 2.0), **kw):
    return Steering(interventions=(Intervention(layer=1, vector=vector, alpha=alpha, **kw),))


def test_key_changes_with_model_facts_steering_and_tokens():
    ident = identity(MODEL)
    assert identity(dict(MODEL)) == ident
    for change in ({"files": "abd"}, {"max_length": 1024}, {"revision": "v2"}, {"dtype": "float16"}):
        assert identity({**MODEL, **change}) != ident
    base = job_prefix(ident, Job(kind="loglikelihood"))
    assert job_prefix(ident, Job(kind="loglikelihood", steering=Steering())) == base  # empty steering: unsteered
    steered = {job_prefix(ident, Job(kind="loglikelihood", steering=s)) for s in (
        steer(), steer(alpha=2.0), steer(vector=(1.0, 2.5)), steer(positions="last"), steer(op="clamp"),
        steer(site="resid_pre"), steer(normalize=True))}  # fmt: skip
    assert len(steered) == 7 and base not in steered  # every field of an intervention is in the key
    assert job_prefix(ident, Job(kind="loglikelihood", steering=steer())) == job_prefix(ident, Job(kind="loglikelihood", steering=steer()))
    assert job_prefix(ident, Job(kind="capture", points=("resid_post.1",))) != job_prefix(ident, Job(kind="capture", points=("resid_post.0",)))
    k = key(base, "loglikelihood", ((1, 2, 3), (4,)))
    assert k == key(base, "loglikelihood", ([1, 2, 3], [4]))  # lists or tuples: same ids, same key
    assert k != key(base, "loglikelihood", ((1, 2), (3, 4)))  # same tokens, different split
    assert k != key(base, "loglikelihood", ((1, 2, 3), (5,)))
    g = GenRequest(context=(1, 2), until=("\n",), max_gen_toks=8)
    assert key(base, "generate", g) != key(base, "generate", GenRequest(context=(1, 2), until=("\n",), max_gen_toks=9))
    assert key(base, "capture", ((1, 2, 3), -1)) != key(base, "capture", ((1, 2, 3), -2))
    assert key(base, "capture", ((1, 2), 3)) != key(base, "capture", ((1, 2, 3), -1))
    with pytest.raises(ValueError, match="no cache key for request kind"):
        key(base, "embed", (1,))


def test_rows_persist_and_reopen(tmp_path):
    base = identity(MODEL)
    keys = [key(base, "loglikelihood", ((i,), (i + 1,))) for i in range(1200)]
    cache = Cache(tmp_path)
    cache.put(zip(keys[:1000], ([-0.1 * i, i % 2 == 0] for i in range(1000))))
    cache.put([(keys[0], [99.0, False])])  # first write wins
    cache.close()
    again = Cache(tmp_path)
    found = again.get(keys)
    assert len(found) == 1000
    assert found[keys[0]] == [0.0, True] and found[keys[7]] == [-0.1 * 7, False]  # floats round-trip exactly
    gen = key(base, "generate", GenRequest(context=(1,)))
    again.put([(gen, "text ✓")])
    assert again.get([gen]) == {gen: "text ✓"}
