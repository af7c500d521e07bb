"""The result cache: keys depend on what decides a number and nothing else; rows survive a reopen."""

from __future__ import annotations

import pytest

from driver.lm.cache import Cache, grid_keys, identity, job_prefix, key
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


def test_key_changes_with_the_model_identity_alone():
    # Same job, same request: only the model differs, so every key must differ (a result of one model never
    # serves another).
    other = identity({**MODEL, "files": "abd"})
    for job, kind, request in (
        (Job(kind="loglikelihood"), "loglikelihood", ((1, 2), (3,))),
        (Job(kind="loglikelihood", steering=steer()), "loglikelihood", ((1, 2), (3,))),
        (Job(kind="generate"), "generate", GenRequest(context=(1, 2))),
        (Job(kind="capture", points=("resid_post.0",)), "capture", ((1, 2), -1)),
    ):
        mine, theirs = job_prefix(identity(MODEL), job), job_prefix(other, job)
        assert mine != theirs
        assert key(mine, kind, request) != key(theirs, kind, request)
        assert grid_keys(identity(MODEL), "loglikelihood", [job.steering], [((1, 2), (3,))]) != grid_keys(
            other, "loglikelihood", [job.steering], [((1, 2), (3,))]
        )


def test_identity_ignores_the_order_of_the_facts():
    # The driver builds the facts dict in whatever order its code runs: the identity is of the content only.
    reordered = dict(reversed(list(MODEL.items())))
    assert list(reordered) != list(MODEL)
    assert identity(reordered) == identity(MODEL)
    nested = {"a": {"x": 1, "y": [1, 2]}, "b": None}
    assert identity(nested) == identity({"b": None, "a": {"y": [1, 2], "x": 1}})
    assert len(identity(MODEL)) == 16


def test_grid_keys_equal_the_per_configuration_keys():
    """grid_keys(ident, kind, steerings, requests)[c][i] == key(job_prefix(ident, Job(kind, steerings[c])), kind,
    requests[i]): a grid's cells are found by later plain runs of each configuration and the other way round."""
    ident = identity(MODEL)
    steerings = [Steering(), steer(), steer(alpha=-0.5), steer(vector=(0.0, 3.0), positions="last", op="clamp"),
                 Steering(interventions=(Intervention(layer=0, vector=(1.0, 1.0)), Intervention(layer=2, vector=(2.0, 0.5), site="resid_pre")))]  # fmt: skip
    cases = {
        "loglikelihood": [((1, 2, 3), (4,)), ((1, 2), (3, 4)), ((7,), (8, 9, 10)), ((1, 2, 3), (4,))],
        "generate": [GenRequest(context=(1, 2), until=("\n",), max_gen_toks=8), GenRequest(context=(5,), do_sample=True, temperature=0.7, seed=3)],
    }  # fmt: skip
    for kind, requests in cases.items():
        grid = grid_keys(ident, kind, steerings, requests)
        expected = [[key(job_prefix(ident, Job(kind=kind, steering=s)), kind, r) for r in requests] for s in steerings]
        assert grid == expected, kind
        assert len({k for row in grid for k in row}) == len(steerings) * len(set(requests))  # distinct cells
        assert grid_keys(ident, kind, steerings, []) == [[] for _ in steerings]
        assert grid_keys(ident, kind, [], requests) == []
    # the unsteered configuration of a grid is exactly a plain run's key
    plain = job_prefix(ident, Job(kind="loglikelihood"))
    assert grid_keys(ident, "loglikelihood", [Steering()], [((1,), (2,))]) == [[key(plain, "loglikelihood", ((1,), (2,)))]]
    with pytest.raises(ValueError, match="no cache key for request kind"):
        grid_keys(ident, "embed", [Steering()], [(1,)])


def test_cache_folder_is_created_with_its_parents(tmp_path):
    folder = tmp_path / "not" / "yet" / "there"
    cache = Cache(folder)
    k = key(identity(MODEL), "loglikelihood", ((1,), (2,)))
    cache.put([(k, [-1.5, True])])
    cache.close()
    assert (folder / "results.sqlite").is_file()
    assert Cache(folder).get([k]) == {k: [-1.5, True]}


def test_the_cache_file_is_made_at_its_first_write(tmp_path):
    folder = tmp_path / "cache"
    cache = Cache(folder)
    k = key(identity(MODEL), "loglikelihood", ((1,), (2,)))
    assert cache.get([k]) == {} and not cache.knows(identity(MODEL))  # reads of a cache that holds nothing
    cache.put([])
    cache.close()
    assert not folder.exists()  # a run that wrote nothing (refused, interrupted early) leaves nothing behind
    cache = Cache(folder)
    cache.remember(identity(MODEL))
    assert (folder / "results.sqlite").is_file() and Cache(folder).knows(identity(MODEL))
    cache.close()


def test_writes_are_committed_and_visible_to_another_connection(tmp_path):
    import sqlite3

    cache = Cache(tmp_path)
    k = key(identity(MODEL), "loglikelihood", ((1,), (2,)))
    cache.put([(k, [-0.25, False])])
    other = sqlite3.connect(tmp_path / "results.sqlite")  # durable once put returns: no close needed
    try:
        assert other.execute("SELECT value FROM results WHERE key = ?", (k,)).fetchall() == [("[-0.25, false]",)]
        assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"  # readers don't block the writer
    finally:
        other.close()
        cache.close()


def _foreign(path):
    import sqlite3

    db = sqlite3.connect(path)
    db.execute("CREATE TABLE notes (id INTEGER, body TEXT)")
    db.execute("INSERT INTO notes VALUES (1, 'keep me')")
    db.commit()
    db.close()


@pytest.mark.parametrize("kind", ["corrupt", "foreign", "folder", "wrong-columns"])
def test_a_corrupt_or_foreign_results_file_is_refused_and_never_written(tmp_path, kind):
    import sqlite3

    path = tmp_path / "results.sqlite"
    if kind == "corrupt":
        path.write_bytes(b"this is not a database at all\n" * 200)
    elif kind == "foreign":
        _foreign(path)
    elif kind == "folder":
        path.mkdir()
    else:
        db = sqlite3.connect(path)
        db.execute("CREATE TABLE results (key TEXT, value BLOB)")
        db.commit()
        db.close()
    before = sorted((p.name, p.read_bytes()) for p in tmp_path.iterdir() if p.is_file())
    with pytest.raises(ValueError) as e:
        Cache(tmp_path)
    message = str(e.value)
    assert "\n" not in message and str(path) in message and "move it away" in message
    after = sorted((p.name, p.read_bytes()) for p in tmp_path.iterdir() if p.is_file())
    assert after == before  # untouched: no table added, no WAL or journal file left beside it


def test_an_empty_sqlite_file_becomes_a_cache(tmp_path):
    import sqlite3

    sqlite3.connect(tmp_path / "results.sqlite").close()  # zero tables: Orchard may create its own
    cache = Cache(tmp_path)
    k = key(identity(MODEL), "capture", ((1, 2), -1))
    cache.put([(k, "x")])
    assert cache.get([k]) == {k: "x"}
    cache.close()


def test_key_format_is_pinned():
    # A cache written by one version must be found by the next: these digests change only with a deliberate
    # change of the key format (which makes every existing results.sqlite miss; say so in the change).
    ident = identity(MODEL)
    assert ident.hex() == "46ff543e224b971522996ece5ee2883b"
    ll = job_prefix(ident, Job(kind="loglikelihood"))
    assert ll.hex() == "a5e9319f8fc9060eb2b983c9747cb144"
    assert key(ll, "loglikelihood", ((1, 2, 3), (4,))).hex() == "2657255e99cca8a15e3818c591c0cb8d"
    gen = key(job_prefix(ident, Job(kind="generate")), "generate", GenRequest(context=(1, 2), until=("\n",), max_gen_toks=8))
    assert gen.hex() == "3d7f9bd90d03696836280fc5c00ce00a"
    cap = key(job_prefix(ident, Job(kind="capture", points=("resid_post.0",))), "capture", ((1, 2), -1))
    assert cap.hex() == "47e1ea291ce7eca5adae1354774459e9"


def test_close_releases_the_connection(tmp_path):
    import sqlite3

    cache = Cache(tmp_path)
    cache.close()
    with pytest.raises(sqlite3.ProgrammingError):
        cache.get([b"k" * 16])


def test_keys_equal_the_per_request_keys():
    # driver.lm.cache.keys is a faster spelling of [key(prefix, kind, r) for r in requests]: a context shared by
    # several requests (the same tuple object) is hashed once, and nothing else changes.
    from driver.lm.cache import keys

    prefix = job_prefix(identity(MODEL), Job(kind="loglikelihood"))
    shared, other = (1, 2, 3), [1, 2, 3]  # equal ids, different objects; and a list spelling
    ll = [(shared, (4,)), (shared, (5, 6)), (other, (4,)), ((1, 2), (3, 4)), (shared, ()), ((9,), (4,))]
    assert keys(prefix, "loglikelihood", ll) == [key(prefix, "loglikelihood", r) for r in ll]
    assert len(set(keys(prefix, "loglikelihood", ll))) == 5  # (shared, (4,)) and (other, (4,)) are one request
    gen = [GenRequest(context=(1, 2)), GenRequest(context=(1, 2), max_gen_toks=9)]
    assert keys(prefix, "generate", gen) == [key(prefix, "generate", g) for g in gen]
    cap = [((1, 2), -1), ((1, 2), 0)]
    assert keys(prefix, "capture", cap) == [key(prefix, "capture", c) for c in cap]
    assert keys(prefix, "loglikelihood", []) == []


def test_the_cache_remembers_whose_results_it_holds(tmp_path):
    import sqlite3

    old = tmp_path / "old"  # a cache written before the models table existed
    old.mkdir()
    db = sqlite3.connect(old / "results.sqlite")
    db.execute("CREATE TABLE results (key BLOB PRIMARY KEY, value TEXT NOT NULL)")
    db.commit()
    db.close()
    a, b = identity({"model": "a"}), identity({"model": "b"})
    cache = Cache(old)
    assert not cache.knows(a)
    cache.remember(a)
    cache.remember(a)
    assert cache.knows(a) and not cache.knows(b)
    cache.close()
    cache = Cache(old)
    assert cache.knows(a) and not cache.knows(b)  # durable
    cache.close()


def test_a_cache_made_on_one_thread_is_used_and_closed_on_another(tmp_path):
    """An executor's finalizer closes its cache on whichever thread collects it (once a ProgrammingError
    warning in the test run: sqlite refuses a connection used off the thread that made it)."""
    import sqlite3
    import threading

    cache = Cache(tmp_path)
    cache.put([(b"k" * 16, 1)])
    errors: list[BaseException] = []

    def elsewhere() -> None:
        try:
            assert cache.get([b"k" * 16]) == {b"k" * 16: 1}
            cache.put([(b"j" * 16, [2])])
            assert cache.knows(b"m" * 16) is False
            cache.close()
        except BaseException as e:  # noqa: BLE001 (reported below, on the test's thread)
            errors.append(e)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert errors == []
    with pytest.raises(sqlite3.ProgrammingError, match="closed"):
        cache.get([b"k" * 16])
    again = Cache(tmp_path)
    assert again.get([b"j" * 16]) == {b"j" * 16: [2]}  # written on the other thread, committed
    again.close()
