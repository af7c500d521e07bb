"""Prints max |Δ| between Orchard's `mlx` and lm-eval's `hf` backend on the local parity tasks (tiny llama, gpt2).

    python bench/parity.py      # needs the test extras (torch, transformers, accelerate)
"""
import os, sys, tempfile
os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=tempfile.mkdtemp(), TOKENIZERS_PARALLELISM="false")
import lm_eval, driver
from lm_eval.tasks import TaskManager
from testbed.tasks import write_tasks
from testbed.models import write_model
root = tempfile.mkdtemp()
tm = TaskManager(include_path=str(write_tasks(f"{root}/tasks")))
for arch in ("llama", "gpt2"):
    path = write_model(f"{root}/{arch}", arch=arch)
    runs = {m: lm_eval.simple_evaluate(model=m, model_args=f"pretrained={path},max_length=64" + (",dtype=float32" if m == "hf" else ""),
            tasks=["orchard_mc", "orchard_ppl", "orchard_gen"], task_manager=tm, log_samples=True, batch_size=8, device="cpu", verbosity="ERROR")
            for m in ("mlx", "hf")}
    for task in ("orchard_mc", "orchard_ppl", "orchard_gen"):
        pairs = [(x[0], y[0]) for a, b in zip(runs["mlx"]["samples"][task], runs["hf"]["samples"][task]) for x, y in zip(a["resps"], b["resps"])]
        if task == "orchard_mc":
            print(arch, task, "max|dLL|", max(abs(x[0] - y[0]) for x, y in pairs), "greedy differ", sum(x[1] != y[1] for x, y in pairs))
        elif task == "orchard_ppl":
            print(arch, task, "max|dLL| per document", max(abs(x - y) for x, y in pairs), "max rel", max(abs(x - y) / abs(y) for x, y in pairs))
        else:
            print(arch, task, "identical generations", sum(x == y for x, y in pairs), "of", len(pairs))
