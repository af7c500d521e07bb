"""The result cache: keys depend on what decides a number and nothing else; rows survive a reopen."""

from __future__ import annotations

from driver.cache import Cache, identity, key
from worker.generate import GenRequest

MODEL = {"model": "org/m", "revision": None, "adapter": None, "files": "abc", "dtype": None, "max_length": 2048}


def test_key_changes_with_model_facts_steering_and_tokens():
    base = identity(MODEL)
    assert identity(dict(MODEL)) == base
    for change in ({"files": "abd"}, {"max_length": 1024}, {"revision": "v2"}, {"dtype": "float16"}):
        assert identity({**MODEL, **change}) != base
    assert identity(MODEL, steering={"layer": 3}) != base
    k = key(base, "loglikelihood", ((1, 2, 3), (4,)))
    assert k == key(base, "loglikelihood", ([1, 2, 3], [4]))  # lists or tuples: same ids, same key
    assert k != key(base, "loglikelihood", ((1, 2), (3, 4)))  # same tokens, different split
    assert k != key(base, "loglikelihood", ((1, 2, 3), (5,)))
    g = GenRequest(context=(1, 2), until=("\n",), max_gen_toks=8)
    assert key(base, "generate", g) != key(base, "generate", GenRequest(context=(1, 2), until=("\n",), max_gen_toks=9))


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
