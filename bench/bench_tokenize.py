"""Benchmark: head-side tokenization of lm-eval `mmlu` 5-shot loglikelihood requests (issue 9 §2).

    python bench/bench_tokenize.py                      # all 56,168 requests (lm-eval builds them: minutes)
    python bench/bench_tokenize.py --limit 20           # the first 20 questions of each subject
    python bench/bench_tokenize.py --pairs /tmp/p.pkl   # keep lm-eval's requests in a pickle, reuse them next time
    python bench/bench_tokenize.py --anchor-seconds 0   # anchor on every request (slow: ~3 min per tokenizer)

Requests come from real lm-eval (TaskManager + get_task_dict(["mmlu"]), num_fewshot=5, build_all_requests)
over the offline `cais/mmlu` cache in ../shared/data/hf-datasets (a temp copy). For each tokenizer it times

  anchor  the per-request path: TemplateLM.loglikelihood's loop with OrchardLM.tok_encode (tokenizer.encode of
          context and context+continuation per request), on a time budget: a seeded random sample of requests
  fast    driver.lm.tokenize.encode_pairs on every request (plan included), TOKENIZERS_PARALLELISM off and on

and says whether fast equals the anchor on every request the anchor ran. Tokenizers: GPT-2 byte-level BPE
(../shared/data/tokenizers/gpt2), the sentencepiece-style Llama of ../shared/models/stories260K, and a generated
Qwen2-style one (Split regex + byte-level BPE, trained here on the requests' text). Not a test: it prints a table.
"""

from __future__ import annotations

import argparse
import os
import pickle
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from driver.lm.tokenize import encode_pair_exact, encode_pairs, make_plan  # noqa: E402

QWEN2_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def mmlu_pairs(limit: int | None, shots: int = 5) -> list[tuple[str, str]]:
    """lm-eval's own `mmlu` loglikelihood requests (context, continuation), subjects in lm-eval's order."""
    cache = Path(tempfile.mkdtemp(prefix="orchard-bench-hf-"))
    try:
        shutil.copytree(SHARED / "data" / "hf-datasets" / "cais___mmlu", cache / "cais___mmlu")
        os.environ["HF_DATASETS_CACHE"] = str(cache)  # read when `datasets` is imported: import below
        import datasets
        from lm_eval.tasks import TaskManager, get_task_dict

        datasets.config.HF_DATASETS_CACHE = cache
        tasks = get_task_dict(["mmlu"], TaskManager())
        pairs = []
        for task in _leaves(tasks):
            task.set_config(key="num_fewshot", value=shots)  # as simple_evaluate(num_fewshot=5) does
            task.build_all_requests(limit=limit, rank=0, world_size=1)
            pairs += [tuple(inst.args) for inst in task.instances]
        return pairs
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _leaves(tasks: dict):
    for value in tasks.values():
        yield from (_leaves(value) if isinstance(value, dict) else [value])


def write_qwen2_like(out: Path, texts: list[str], vocab_size: int = 8192) -> Path:
    """A Qwen2-style tokenizer (Split regex isolating digits, byte-level BPE, no BOS added) trained on `texts`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)  # fmt: skip
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|endoftext|>")
    fast.save_pretrained(str(out))
    return out


def prefix_id(tok) -> int:
    return tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id  # OrchardLM.prefix_token_id


def anchor(tok, pairs: list, order: list[int], seconds: float) -> tuple[dict[int, tuple], float]:
    """The per-request loop on requests in `order` until `seconds` run out (0: all): {index: pair}, req/s."""
    pref, out = prefix_id(tok), {}
    bos = tok.decode(pref)
    start = time.perf_counter()
    for i in order:
        out[i] = encode_pair_exact(tok, *pairs[i], pref, bos)
        if seconds and time.perf_counter() - start > seconds:
            break
    return out, len(out) / (time.perf_counter() - start)


def fast(tok, pairs: list, parallel: bool) -> tuple[list, float, str]:
    start = time.perf_counter()
    plan = make_plan(tok)
    got = encode_pairs(tok, pairs, prefix_id(tok), plan=plan, parallel=parallel)
    return got, len(pairs) / (time.perf_counter() - start), ("cut: " if plan.safe else "whole: ") + plan.reason


def tokenizers_to_run(pairs: list, workdir: Path) -> list[tuple[str, object]]:
    from transformers import AutoTokenizer

    out = []
    for name, path in (("gpt2 (byte-level BPE)", SHARED / "data/tokenizers/gpt2"), ("stories260K (sentencepiece-style)", SHARED / "models/stories260K")):
        if (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists():
            out.append((name, AutoTokenizer.from_pretrained(str(path))))
    texts = sorted({c for c, _ in pairs})[:: max(1, len(pairs) // 4000)][:1000]  # a spread of prompts, seconds to train
    start = time.perf_counter()
    qwen = AutoTokenizer.from_pretrained(str(write_qwen2_like(workdir / "qwen2-like", texts)))
    print(f"generated Qwen2-style tokenizer: vocab {len(qwen)}, trained in {time.perf_counter() - start:.1f} s")
    return out + [("generated Qwen2-style (split regex)", qwen)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=None, help="questions per subject (default: all)")
    ap.add_argument("--pairs", type=Path, default=None, help="pickle of the requests: read if present, else written")
    ap.add_argument("--anchor-seconds", type=float, default=20.0, help="time budget of the per-request anchor (0: all)")
    args = ap.parse_args()
    print(f"cpus {os.cpu_count()}, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, "
          f"TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM', '(unset: on)')} in the environment")  # fmt: skip
    if args.pairs and args.pairs.exists():
        pairs = pickle.loads(args.pairs.read_bytes())
        print(f"requests: {len(pairs)} read from {args.pairs}")
    else:
        if not (SHARED / "data" / "hf-datasets" / "cais___mmlu").is_dir():
            sys.exit("../shared/data/hf-datasets is absent: no offline MMLU to build requests from")
        start = time.perf_counter()
        pairs = mmlu_pairs(args.limit)
        print(f"requests: {len(pairs)} mmlu 5-shot, built by lm-eval in {time.perf_counter() - start:.1f} s")
        if args.pairs:
            args.pairs.write_bytes(pickle.dumps(pairs))
    order = list(range(len(pairs)))
    random.Random(0).shuffle(order)
    rows, notes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name, tok in tokenizers_to_run(pairs, Path(tmp)):
            got_off, off, why = fast(tok, pairs, parallel=False)
            got_on, on, _ = fast(tok, pairs, parallel=True)
            ref, rate = anchor(tok, pairs, order, args.anchor_seconds)
            same = got_off == got_on and all(got_off[i] == pair for i, pair in ref.items())
            rows.append((name, len(pairs), len(ref), rate, off, on, max(off, on) / rate, "yes" if same else "NO"))
            notes.append(f"{name}: {why}")
    print(f"\n{'tokenizer':36} {'requests':>8} {'anchor n':>8} {'anchor req/s':>12} {'fast req/s (par off)':>20} "
          f"{'fast req/s (par on)':>19} {'ratio':>6} {'identical':>9}")  # fmt: skip
    for name, n, m, rate, off, on, ratio, same in rows:
        print(f"{name:36} {n:>8} {m:>8} {rate:>12.0f} {off:>20.0f} {on:>19.0f} {ratio:>5.1f}x {same:>9}")
    print("\nidentical: fast == anchor on every request the anchor ran (anchor n), and par off == par on on all")
    print("\n".join(notes))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
