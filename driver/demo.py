"""`driver demo`'s material: the shipped TinyStories-260K model and its three tasks, lm-eval YAMLs over
examples/tinystories/*.jsonl.

The data ships as files; the YAMLs are written next to a copy of them (lm-eval's `json` datasets need absolute
paths), so the folder works as `--include-path` from anywhere.
"""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "examples"
MODEL = ROOT / "stories260K"
DATA = ROOT / "tinystories"
TASKS = ("tinystories_mc", "tinystories_ppl", "tinystories_gen")

_YAML = {
    "tinystories_mc": """\
task: tinystories_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/mc.jsonl
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
""",
    "tinystories_ppl": """\
task: tinystories_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/stories.jsonl
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false
""",
    "tinystories_gen": """\
task: tinystories_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/gen.jsonl
output_type: generate_until
test_split: test
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 12
  do_sample: false
filter_list:
  - name: first-word
    filter:
      - function: regex
        regex_pattern: "(\\\\w+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""",
}


def write_story_tasks(folder: str | Path) -> Path:
    """Copy the shipped data into `folder` and write the three task YAMLs pointing at it; returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("mc.jsonl", "stories.jsonl", "gen.jsonl"):
        shutil.copyfile(DATA / name, folder / name)
    for task, text in _YAML.items():
        (folder / f"{task}.yaml").write_text(text.format(data=folder.resolve()))
    return folder
