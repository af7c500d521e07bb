"""driver.lm.tokenize: fast head-side tokenization, token-identical to lm-eval's TemplateLM path per request (the
reference is lm-eval's own TemplateLM.loglikelihood and _encode_pair, not a copy of their rules).

Real MMLU 5-shot requests come from lm-eval itself (offline cais/mmlu cache set up by conftest). lm-eval takes
~100 CPU-s to build all 56,168 requests and the per-request reference path runs ~300 req/s here, so by default
the comparison covers the first LIMIT questions of every one of the 57 subjects (all few-shot prefixes, every
subject's prompt format); ORCHARD_TOKENIZE_FULL=1 compares every request of full MMLU 5-shot (~10 min).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM

from driver.lm.mlx import OrchardLM
from driver.lm.tokenize import encode_pairs, iter_encode_pairs, make_plan

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
LIMIT = None if os.environ.get("ORCHARD_TOKENIZE_FULL") == "1" else 6
REAL = {"gpt2": SHARED / "data" / "tokenizers" / "gpt2", "stories260K": SHARED / "models" / "stories260K"}


def _prefix(tok) -> int:
    return tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id  # OrchardLM.prefix_token_id


class _LmEval(OrchardLM):
    """lm-eval's own tokenization of loglikelihood requests (TemplateLM.loglikelihood: the empty-context rule
    and _encode_pair) with OrchardLM's tok_encode, on any tokenizer: no model, no copy of lm-eval's rules."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    loglikelihood = TemplateLM.loglikelihood

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        return [(tuple(ctx), tuple(cont)) for _, ctx, cont in requests]


def _reference(tok, pairs):
    """What lm-eval itself hands the model for each (context, continuation)."""
    return _LmEval(tok).loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)], disable_tqdm=True)


def _auto(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def mmlu_pairs(offline_mmlu):
    from lm_eval.tasks import TaskManager, get_task_dict

    def leaves(d):
        for v in d.values():
            yield from (leaves(v) if isinstance(v, dict) else [v])

    pairs = []
    for task in leaves(get_task_dict(["mmlu"], TaskManager())):
        task.set_config(key="num_fewshot", value=5)  # as simple_evaluate(num_fewshot=5)
        task.build_all_requests(limit=LIMIT, rank=0, world_size=1)
        pairs += [tuple(i.args) for i in task.instances]
    assert len(pairs) == (56168 if LIMIT is None else 57 * LIMIT * 4)
    return pairs


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_mmlu_5shot_identical(name, mmlu_pairs):
    if not (REAL[name] / "tokenizer.json").exists():
        pytest.skip(f"{REAL[name]} is absent")
    tok = _auto(REAL[name])
    plan = make_plan(tok)
    assert plan.safe is not None, plan.reason  # the fast, cut path was proved for both
    got = encode_pairs(tok, mmlu_pairs, _prefix(tok), plan=plan)
    assert got == _reference(tok, mmlu_pairs)
    streamed = [p for chunk in iter_encode_pairs(tok, mmlu_pairs, _prefix(tok), chunk_size=97, plan=plan) for p in chunk]
    assert streamed == got


EDGE_PAIRS = [
    ("", "hello world"),
    ("", " leading space"),
    ("Question: 2+2?\nAnswer: ", "A"),
    ("Question: 2+2?\nAnswer:", " A"),
    ("Question: 2+2?\nAnswer:", "A"),
    ("Q one.\n\n", "A"),
    ("Q one.\n\n\n\nQ two:\t ", " B"),
    ("   ", "x"),
    ("\n\nstarts with a break\n\nQ:", " yes"),
    ("Title.\n\nQ1\nAnswer: B\n\nQ2 (A) 42.\n\nAnswer:", " C"),
    ("Ctx 1.\n\nQ:", " A\n\nB continues\n\n"),
    ("Ctx 2.\n\nQ:", ""),
    ("héllo wörld 日本語 😀\n\nQ: ça va?", " ✓ oui"),
    ("a\u00a0b\n\nc\u00a0", "\u00a0d"),
    ("Windows.\r\n\r\nline\r\n", "end"),
    ("x  \n\n  y   z  ", "  w  "),
    ("number 123\n\n4567\n\n89", " 0"),
]  # fmt: skip


def _generated(kind: str, tmp: Path):
    """Generated tokenizers of several families; `whitespace` has a pre-tokenizer no cut rule covers."""
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_tokenize import write_qwen2_like
    from testbed.models import _corpus, write_tokenizer

    if kind == "qwen2":
        return _auto(write_qwen2_like(tmp / kind, _corpus(), vocab_size=600))
    if kind == "whitespace":
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.train_from_iterator(_corpus(), trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", "<s>"], show_progress=False))
        return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<s>", unk_token="<unk>")
    write_tokenizer(tmp / kind, vocab_size=600, style=kind)
    return _auto(tmp / kind)


def _with_bos_cases(tok) -> list[tuple[str, str]]:
    bos = tok.decode(_prefix(tok))
    return EDGE_PAIRS + [
        (bos + "Hello there.\n\nQ:", " A"),  # starts with the BOS text: add_special_tokens=False
        ("Hello " + bos + " mid.\n\nQ:", " A"),  # added-token text inside: encoded whole
        # contexts that are strict prefixes of the BOS text: only the whole string starts with it (llama)
        (bos[:-1], bos[-1:] + " after that, the end"),
        (bos[:1], bos[1:] + "\n\nQ:"),
        ("", bos + " after"),  # the continuation starts with the prefix token
        ("", bos),
    ]


@pytest.mark.parametrize("kind,cut", [("llama", True), ("gpt2", True), ("qwen2", True), ("whitespace", False)])
def test_generated_edge_cases(kind, cut, tmp_path):
    tok = _generated(kind, tmp_path)
    plan = make_plan(tok)
    assert (plan.safe is not None) == cut, plan.reason
    pairs = _with_bos_cases(tok)
    want = _reference(tok, pairs)
    assert encode_pairs(tok, pairs, _prefix(tok), plan=plan) == want
    for parallel in (True, False):  # chunks of 2: pieces come from the cache across chunks
        chunks = list(iter_encode_pairs(tok, pairs, _prefix(tok), chunk_size=2, plan=plan, parallel=parallel))
        assert [p for c in chunks for p in c] == want
    assert want[-2][0] == (_prefix(tok),)  # the prefix-token case really was exercised


def test_empty_context_and_continuation_fails_like_lm_eval(tmp_path):
    tok = _generated("gpt2", tmp_path)
    with pytest.raises(IndexError):
        _reference(tok, [("", "")])
    with pytest.raises(IndexError):
        encode_pairs(tok, [("", "")], _prefix(tok))


class _Slow:
    """A tokenizer without a Rust backend: only encode/decode, like a slow (Python) HF tokenizer."""

    is_fast = False

    def __init__(self, tok):
        self.tok, self.bos_token_id, self.eos_token_id = tok, tok.bos_token_id, tok.eos_token_id

    def encode(self, s, **kw):
        return self.tok.encode(s, **kw)

    def decode(self, ids, **kw):
        return self.tok.decode(ids, **kw)


def test_slow_tokenizer_takes_the_exact_path(tmp_path):
    slow = _Slow(_generated("llama", tmp_path))
    plan = make_plan(slow)
    assert plan.backend is None and "not a fast tokenizer" in plan.reason
    pairs = _with_bos_cases(slow)
    assert encode_pairs(slow, pairs, _prefix(slow), plan=plan) == _reference(slow, pairs)
