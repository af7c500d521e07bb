"""The head streams: requests are tokenized in pieces on a feed thread while workers already score earlier
pieces; tokens equal lm-eval's own path; a piece that differs falls back to it."""

from __future__ import annotations

import sys
import threading
import time

import pytest
from lm_eval.api.instance import Instance

from driver.lm.mlx import MLXLM
from driver.lm.stream import FIRST_PIECE, LARGEST_PIECE, pieces, spot_checks
from cluster.schedule import Feed


def questions(n: int) -> list[tuple[str, str]]:
    """n four-choice questions: four requests sharing each context, contexts with trailing spaces and without."""
    pairs = []
    for q in range(n):
        context = f"Question {q}: what follows {q % 7} in the story?\nAnswer:" + (" " if q % 3 == 0 else "")
        pairs += [(context, f" choice {c} of {q}") for c in "ABCD"]
    return pairs


def instances(pairs):
    return [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]


def test_pieces_cover_everything_in_order_grow_and_keep_a_questions_choices_together():
    contexts = [c for c, _ in questions(1000)] + [""] * 3
    bounds = list(pieces(contexts))
    assert bounds[0][0] == 0 and bounds[-1][1] == len(contexts)
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, in order
    assert all(contexts[hi - 1] != contexts[hi] for _, hi in bounds[:-1])  # a cut never splits a question
    sizes = [hi - lo for lo, hi in bounds]
    assert FIRST_PIECE <= sizes[0] < FIRST_PIECE + 4 and sizes[1] >= 2 * FIRST_PIECE
    assert max(sizes) <= LARGEST_PIECE + 3 and len(bounds) > 3
    assert list(pieces([])) == [] and list(pieces(["x"])) == [(0, 1)]


def test_spot_checks_are_inside_the_piece_and_include_its_ends():
    assert spot_checks(10, 11) == [10]
    assert spot_checks(0, 100)[0] == 0 and spot_checks(0, 100)[-1] == 99 and len(spot_checks(0, 100)) == 4
    assert spot_checks(5, 5) == []


def test_feed_hands_pieces_over_in_order_and_raises_the_producers_error():
    gate = threading.Event()

    def produce():
        yield [1]
        gate.wait(5)
        yield [2, 3]

    feed = Feed(produce())
    assert feed.take(5) == [1]
    assert feed.take(0) is None  # the producer is still busy: nothing yet, no waiting
    gate.set()
    assert feed.take(5) == [2, 3]
    with pytest.raises(StopIteration):
        feed.take(5)

    def broken():
        yield [1]
        raise ValueError("bad request 7")

    feed = Feed(broken())
    assert feed.take(5) == [1]
    with pytest.raises(ValueError, match="bad request 7"):
        feed.take(5)


@pytest.fixture(scope="module")
def local_lm(llama_path):
    return MLXLM(pretrained=str(llama_path), batch_size=8)


def test_streamed_tokens_equal_lm_evals_own_path(local_lm):
    pairs = questions(200) + [("", " an empty context"), ("Trailing newline\n", "x")]
    bounds = list(pieces([c for c, _ in pairs]))
    assert len(bounds) >= 2
    streamed = [p for piece in local_lm.encode_pieces(pairs, bounds) for p in piece]
    assert streamed == [local_lm._exact(*p) for p in pairs]
    assert local_lm._token_plan.backend is not None  # the fast path ran (the test tokenizer is a fast one)


def test_a_piece_that_differs_from_lm_eval_falls_back_to_its_path(local_lm, monkeypatch, capsys):
    import driver.lm.mlx as lm_module

    real = lm_module.iter_encode_pairs

    def wrong_first(*args, **kwargs):
        for n, piece in enumerate(real(*args, **kwargs)):
            if n == 1:
                piece = [((1, 2, 3), piece[0][1])] + piece[1:]  # the piece's first request: wrong context ids
            yield piece

    monkeypatch.setattr(lm_module, "iter_encode_pairs", wrong_first)
    lm = MLXLM(pretrained=local_lm.tokenizer.name_or_path, batch_size=8)
    pairs = questions(200)
    bounds = list(pieces([c for c, _ in pairs]))
    out = [p for piece in lm.encode_pieces(pairs, bounds) for p in piece]
    assert out == [lm._exact(*p) for p in pairs]
    assert "fast tokenization differs from lm-eval's on a request: using lm-eval's path" in capsys.readouterr().err
    assert lm._token_plan.backend is None


def test_loglikelihood_is_the_same_streamed_or_whole(local_lm):
    pairs = questions(90)
    streamed = local_lm.loglikelihood(instances(pairs), disable_tqdm=True)
    whole = local_lm._loglikelihood_tokens([(p, *local_lm._exact(*p)) for p in pairs])
    assert streamed == whole


# --- on a real cluster: workers score the first pieces while the head still tokenizes the rest -------------------

ray = pytest.importorskip("ray")
from ray import cloudpickle  # noqa: E402

from cluster import WorkerActor  # noqa: E402
from driver.lm.mlx_ray import MLXRayLM  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Clocked(WorkerActor):
    """Records when each chunk started (wall clock: the head and the workers share this machine)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.starts: list[float] = []

    def run(self, job, indices, requests):
        self.starts.append(time.time())
        return super().run(job, indices, requests)

    def chunk_starts(self) -> list[float]:
        return self.starts


class SlowHead(MLXRayLM):
    """A head that takes 1 s per piece to tokenize: the overlap with the workers is then plain to see."""

    actor_cls = Clocked

    def __init__(self, *args, **kwargs):
        self.produced: list[float] = []  # when each piece was tokenized
        super().__init__(*args, **kwargs)

    def encode_pieces(self, pairs, bounds):
        for piece in super().encode_pieces(pairs, bounds):
            time.sleep(1.0)
            self.produced.append(time.time())
            yield piece


def test_workers_start_on_the_first_piece_while_the_head_tokenizes_the_rest(ray_cluster, llama_path, local_lm):
    pairs = questions(200)  # 800 requests: pieces of 256, 512, 32
    lm = SlowHead(pretrained=str(llama_path), workers=2, batch_size=8)
    try:
        lm.executor.wait_ready()  # in a real run the workers load while lm-eval builds its requests
        got = lm.loglikelihood(instances(pairs), disable_tqdm=True)
        starts = sorted(t for a in lm.executor.actors for t in ray.get(a.chunk_starts.remote()))
    finally:
        lm.executor.close()
    assert len(lm.produced) == 3
    assert starts[0] < lm.produced[-1] - 0.5  # a worker ran a chunk before the last piece was tokenized
    want = local_lm.loglikelihood(instances(pairs), disable_tqdm=True)
    assert max(abs(a - b) for (a, _), (b, _) in zip(got, want)) < 1e-4
    assert [g for _, g in got] == [g for _, g in want]


def test_batched_cache_keys_equal_one_key_per_request(local_lm):
    from driver.lm.cache import key, keys

    pairs = questions(30) + [("", " x")]
    encoded = [p for piece in local_lm.encode_pieces(pairs, [(0, len(pairs))]) for p in piece]
    prefix = b"0123456789abcdef"
    assert keys(prefix, "loglikelihood", encoded) == [key(prefix, "loglikelihood", r) for r in encoded]
    copies = [(tuple(c), tuple(x)) for c, x in encoded]  # equal contents in other objects: the same keys
    assert keys(prefix, "loglikelihood", copies) == keys(prefix, "loglikelihood", encoded)


def test_one_progress_bar_counts_every_request_type_and_keeps_cached_ones_apart():
    import io

    from driver.lm.progress import Progress

    progress = Progress(["w0@a", "w1@b"])
    progress.expect(100, 40, "loglikelihood")  # 100 requests, 40 of them from the cache
    bar = progress.bar
    bar.fp = io.StringIO()
    progress.advance(0, 50)
    progress.expect(10, 0, "generate")  # the next request type: the same bar grows
    assert progress.bar is bar and bar.total == 70 and bar.n == 50
    progress.advance(1, 20, "configs 3/4")
    assert bar.n == 70 and "40 cached" in bar.postfix and "configs 3/4" in bar.postfix
    assert "w0 " in bar.postfix and "71%" in bar.postfix and "w1 " in bar.postfix and "29%" in bar.postfix
    progress.close()
    progress.expect(5, 0, "loglikelihood")  # after close (results printed), a new bar
    assert progress.bar is not bar and progress.bar.total == 5 and progress.cached == 0
    progress.close()

    waiting = Progress()  # no worker holds the model yet (or none is needed): no bar, the counts kept
    waiting.expect(30, 10, "loglikelihood")
    assert waiting.bar is None
    waiting.workers(["w0@a"])
    assert waiting.bar.total == 20 and waiting.cached == 10
    waiting.bar.fp = io.StringIO()
    waiting.close()
