"""The loss line of a group of 3 (issue 38.9) named "rank 1" whichever of the three processes was killed: the
first rank Ray counted dead won, and a killed rank's ring peers die moments after it (Ray may record one of them
first). It now names the rank that died first (Ray's end time), on its node: pure below with Ray's actor records,
then on real Ray (the session's loopback cluster) with a real ring of 3 whose last rank is killed."""

from __future__ import annotations

import sys

import pytest

from cluster.groups import pool


@pytest.fixture
def records(monkeypatch):
    """Ray's actor record per rank (by the actor's name here), as cluster.failures reads them."""
    table: dict[str, dict] = {}
    monkeypatch.setattr(pool, "_actor_id", lambda actor: actor)
    monkeypatch.setattr(pool, "_actor_record", lambda actor_id: table.get(actor_id, {}))
    monkeypatch.setattr(pool, "node_label", lambda node, ip: f"node-{node}")
    return table


def _dead(end: int, node: str) -> dict:
    return {"State": "DEAD", "EndTime": end, "Address": {"NodeID": node, "IPAddress": "127.0.0.1"}}


def test_the_rank_that_died_first_is_named_not_the_lowest(records):
    group = pool.GroupHandle(["r0", "r1", "r2"], index=0)
    records.update(r0={"State": "ALIVE"}, r1=_dead(2000, "b"), r2=_dead(1000, "c"))
    assert group.why(settle_s=0.0, others_s=0.0) == "rank 2 on node-c died"
    records.update(r1=_dead(500, "b"))
    assert group.why(settle_s=0.0, others_s=0.0) == "rank 1 on node-b died"
    records.clear()
    assert group.why(settle_s=0.0, others_s=0.0) == "its ring broke"


ray = pytest.importorskip("ray")

from ray import cloudpickle  # noqa: E402

from test_groups import grouped, open_lm, tasks  # noqa: E402,F401
from test_guards_probe_loss import Slower, lost_run  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module


def test_killing_the_last_rank_of_a_group_of_3_names_it(ray_cluster, stories_path, tasks):  # noqa: F811
    lm = open_lm(stories_path, grouped(Slower), group_size=3, split="pipeline", workers=1, max_restarts=0)
    error = lost_run(lm, tasks, rank=2, seconds=180)
    assert str(error).startswith("every worker group is lost (group g0 lost: rank 2 on "), str(error)
