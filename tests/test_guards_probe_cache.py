"""Issue 27.8, internal errors: a cached row that is not JSON, is the wrong kind (a string where a loglikelihood
belongs) or holds NaN is no result: the executor's read leaves it out (so it is computed again), the row is
deleted, and one note names the cache; rows that are results are served as before."""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest

from cluster.intake import Stored
from cluster.schedule import Merge
from driver.lm.cache import Cache

GOOD = {"loglikelihood": [-1.5, True], "generate": " once upon", "capture": [[0.5, -1.0]]}
BAD = {
    "loglikelihood": ["not json {", '"a string"', "[NaN, true]", "[-1.0]", '[-1.0, "yes"]'],
    "generate": ["not json {", "[-1.0, true]", "null"],
    "capture": ["not json {", '"x"', "[[NaN, 1.0]]", "[]"],
}


def _stored(tmp_path, kind: str) -> tuple[Cache, list[bytes]]:
    cache = Cache(tmp_path)
    keys = [bytes([i]) * 16 for i in range(1 + len(BAD[kind]))]
    cache.put([(keys[0], GOOD[kind])])
    with sqlite3.connect(cache.path) as db:  # rows as a damaged or foreign writer left them
        db.executemany("INSERT INTO results VALUES (?, ?)", list(zip(keys[1:], BAD[kind])))
    return cache, keys


@pytest.mark.parametrize("kind", sorted(BAD))
def test_unusable_rows_are_computed_again_and_deleted_with_one_note(tmp_path, capsys, kind):
    cache, keys = _stored(tmp_path, kind)
    merge = Merge(len(keys))
    Stored(cache).read(kind, merge, keys)
    assert merge.missing() == list(range(1, len(keys)))  # only the good row is served
    np.testing.assert_equal(np.asarray(merge.values[0], dtype=object if kind == "loglikelihood" else None),
                            np.asarray(GOOD[kind], dtype=object if kind == "loglikelihood" else None))  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(cache.path) in err[0] and f"{len(keys) - 1} row(s)" in err[0], err
    with sqlite3.connect(cache.path) as db:
        assert db.execute("SELECT COUNT(*) FROM results").fetchone()[0] == 1
    assert set(cache.get(keys, kind)) == {keys[0]}
