"""Small lm-eval tasks that need no download: one per request type, written as YAML + JSONL into a folder.

`driver demo` runs them on the embedded cluster, and tests use them as the shared fixture for parity
between backends (pass the folder as lm-eval's `include_path`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

TASKS = ("orchard_mc", "orchard_ppl", "orchard_gen")

_SUBJECTS = ("biology", "physics", "history")
_WORDS = (
    "water energy cell acid law state court market price theory river mountain city king queen war "
    "peace science number value question answer little girl boy dog cat happy day night tree house"
).split()


def _sentence(rng: np.random.Generator, lo: int = 4, hi: int = 12) -> str:
    return " ".join(rng.choice(_WORDS, size=int(rng.integers(lo, hi)))).capitalize()


def _mc_docs(rng: np.random.Generator, n: int) -> list[dict]:
    return [
        {
            "subject": _SUBJECTS[i % len(_SUBJECTS)],
            "question": _sentence(rng) + "?",
            "choices": [_sentence(rng, 1, 4) for _ in range(4)],
            "answer": int(rng.integers(0, 4)),
        }
        for i in range(n)
    ]


def _write_jsonl(path: Path, docs: list[dict]) -> str:
    path.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs))
    return str(path.resolve())


def write_tasks(folder: str | Path, *, n_docs: int = 12, seed: int = 0) -> Path:
    """Write the three tasks (multiple choice with few-shot, rolling perplexity, generation)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    mc_train = _write_jsonl(folder / "mc_train.jsonl", _mc_docs(rng, 8))
    mc_test = _write_jsonl(folder / "mc_test.jsonl", _mc_docs(rng, n_docs))
    ppl = _write_jsonl(
        folder / "ppl.jsonl",
        [{"text": " ".join(_sentence(rng) + "." for _ in range(int(rng.integers(2, 12)))) + " éà — ok"} for _ in range(n_docs)],
    )
    gen = _write_jsonl(
        folder / "gen.jsonl",
        [{"question": _sentence(rng) + "?", "answer": _sentence(rng, 1, 3)} for _ in range(n_docs)],
    )
    mc_text = (
        "{{question}}\\nA. {{choices[0]}}\\nB. {{choices[1]}}\\nC. {{choices[2]}}\\nD. {{choices[3]}}\\nAnswer:"
    )
    (folder / "orchard_mc.yaml").write_text(
        f"""task: orchard_mc
dataset_path: json
dataset_kwargs:
  data_files:
    train: {mc_train}
    test: {mc_test}
output_type: multiple_choice
training_split: train
fewshot_split: train
test_split: test
description: "The following are multiple choice questions (with answers) about {{{{subject}}}}.\\n\\n"
doc_to_text: "{mc_text}"
doc_to_choice: ["A", "B", "C", "D"]
doc_to_target: answer
num_fewshot: 3
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
    )
    (folder / "orchard_ppl.yaml").write_text(
        f"""task: orchard_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {ppl}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""
    )
    (folder / "orchard_gen.yaml").write_text(
        f"""task: orchard_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen}
output_type: generate_until
test_split: test
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
    )
    return folder
