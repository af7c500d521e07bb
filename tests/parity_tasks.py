"""Parity tasks that reach what the 64-token fixtures cannot: shared few-shot prefixes (families), stop strings
and max_gen_toks truncation. They reuse the data files of testbed.tasks (conftest's `tasks_dir`)."""

from __future__ import annotations

from pathlib import Path

LONG_TASKS = ["orchard_mc_shared", "orchard_gen_stops"]
GEN_UNTIL = ["Cat", "::::"]  # the tiny llama writes "Cat" in some answers; the tiny gpt2 writes ":" forever
GEN_MAX = 10


def write_long_tasks(folder: Path, tasks_dir: Path) -> Path:
    """Every doc of a subject shares the description and the same three shots (first_n): ~150 shared tokens."""
    folder.mkdir(parents=True, exist_ok=True)
    data = {name: (tasks_dir / f"{name}.jsonl").resolve() for name in ("mc_train", "mc_test", "gen")}
    mc_text = "{{question}}\\nA. {{choices[0]}}\\nB. {{choices[1]}}\\nC. {{choices[2]}}\\nD. {{choices[3]}}\\nAnswer:"
    (folder / "orchard_mc_shared.yaml").write_text(
        f"""task: orchard_mc_shared
dataset_path: json
dataset_kwargs:
  data_files:
    train: {data["mc_train"]}
    test: {data["mc_test"]}
output_type: multiple_choice
training_split: train
fewshot_split: train
test_split: test
description: "The following are multiple choice questions (with answers) about {{{{subject}}}}.\\n\\n"
doc_to_text: "{mc_text}"
doc_to_choice: ["A", "B", "C", "D"]
doc_to_target: answer
num_fewshot: 3
fewshot_config:
  sampler: first_n
metric_list:
  - metric: acc
"""
    )
    until = ", ".join(f'"{u}"' for u in GEN_UNTIL)
    (folder / "orchard_gen_stops.yaml").write_text(
        f"""task: orchard_gen_stops
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data["gen"]}
output_type: generate_until
test_split: test
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: [{until}]
  max_gen_toks: {GEN_MAX}
  do_sample: false
metric_list:
  - metric: exact_match
"""
    )
    return folder


def coverage(lm, prompts: list[str], tokenize) -> dict[str, int]:
    """How many generation prompts stop at a stop string, at EOS, or run to max_gen_toks (the kernel, direct)."""
    from worker.generate import GenRequest, generate_tokens

    reqs = [GenRequest(tuple(tokenize(p)), max_gen_toks=GEN_MAX) for p in prompts]
    free = generate_tokens(lm, reqs)  # no stop strings: EOS or max_gen_toks
    stopped = generate_tokens(lm, [GenRequest(r.context, until=tuple(GEN_UNTIL), max_gen_toks=GEN_MAX) for r in reqs])
    out = {"stop": 0, "eos": 0, "max": 0}
    for f, s in zip(free, stopped):
        out["stop" if len(s) < len(f) else "eos" if len(f) < GEN_MAX else "max"] += 1
    return out
