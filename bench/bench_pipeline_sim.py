"""The pipeline schedule at K = 2, 4 and 8 from measured stage and link times (issue 26: "K = 4 and 8 on Macs").

    python bench/bench_pipeline_sim.py [--hidden 768] [--layers 8] [--tokens 48] [--batch 8] [--sim-layers 32]

Two measurements on this machine, each process pinned to a core of its own with one BLAS thread (OpenBLAS
preloaded when present), as bench_pipeline runs its ranks:
- **stage**: one unsplit process times one micro-batch (--batch rows of --tokens tokens) through the body
  (embedding, decoder blocks and final norm, evaluated alone) and through the head at the scored positions
  (vocabulary head and log-softmax of one position a row, as pipelined scoring runs it), best of --repeat; a
  layer's time is the body's over --layers (the embedding and the norm counted in it: a slight overestimate);
- **link**: two processes on a real ring over 127.0.0.1 pass one micro-batch's hidden state (float32 [batch,
  tokens, hidden]) back and forth; one hand-over is half the mean round trip.
Then worker.split.schedule.simulate (each stage runs its micro-batches in order; a hand-over costs one link, and
the sending rank waits for it, as sends do by default: ORCHARD_PIPELINE_OVERLAP off; the efficiency is the ideal
compute time over the simulated makespan) for a model of --sim-layers such layers split evenly
over K ranks (the head on the last), for M micro-batches in flight, with the link measured here and with a
slower link (10 GbE between Macs: the bytes at 1.1 GB/s plus 100 us). M is what a group keeps in flight: within
one chunk its micro-batches, and since a rank takes its next queued chunk as soon as it has sent its last
micro-batch on (every rank holds two chunks: cluster.schedule), a long run keeps the pipe full across chunks.
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
MAC_LINK = (1.1e9, 100e-6)  # bytes/s and seconds of latency: 10 GbE between two Macs, a conservative figure


def _best(fn, repeat: int) -> float:
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return min(out)


def stage_main(task: dict) -> dict:
    """Seconds of one micro-batch through the body and through the head (unsplit, this core)."""
    import mlx.core as mx

    from worker.load import load
    from worker.spec import ModelSpec

    os.sched_setaffinity(0, {0})
    lm = load(ModelSpec(model=task["model"], max_length=512))
    tokens = mx.array([[1, *range(3, 2 + task["tokens"])]] * task["batch"])
    hidden = lm.head.body(tokens)
    mx.eval(hidden)

    def body() -> None:
        mx.eval(lm.head.body(tokens))

    def head() -> None:
        logits = lm.head.head(hidden[:, -1:, :]).astype(mx.float32)
        mx.eval(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    body(), head()  # warm-up
    return {"body": _best(body, task["repeat"]), "head": _best(head, task["repeat"]), "bytes": hidden.size * 4}


def link_main(task: dict, rank: int) -> dict:
    """Half the mean round trip of one hidden state between two ring neighbours."""
    import mlx.core as mx

    from worker.split import join

    os.sched_setaffinity(0, {rank % os.cpu_count()})
    group = join(task["hostfile"], rank)
    x = mx.ones((task["batch"], task["tokens"], task["hidden"]), mx.float32)
    mx.eval(x)

    def trip() -> None:
        if rank == 0:
            mx.eval(mx.distributed.send(x, 1, group=group))
            mx.eval(mx.distributed.recv_like(x, 1, group=group))
        else:
            y = mx.distributed.recv_like(x, 0, group=group)
            mx.eval(y)
            mx.eval(mx.distributed.send(y, 0, group=group))

    for _ in range(3):
        trip()
    n = task["trips"]
    start = time.perf_counter()
    for _ in range(n):
        trip()
    return {"link": (time.perf_counter() - start) / n / 2}


def _run(task: dict, folder: Path, ranks: int) -> list[dict]:
    from bench_pipeline import _env

    path = folder / f"task{ranks}.pkl"
    path.write_bytes(pickle.dumps(task))
    procs = [subprocess.Popen([sys.executable, __file__, "--task", str(path), "--rank", str(r)], env=_env()) for r in range(ranks)]
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:  # a failed or hung rank leaves no other behind
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes):
        raise SystemExit("a measuring process failed")
    return [pickle.loads(path.with_suffix(f".out{r}.pkl").read_bytes()) for r in range(ranks)]


def _child(task_path: str, rank: int) -> None:
    task = pickle.loads(Path(task_path).read_bytes())
    out = link_main(task, rank) if task.get("hostfile") else stage_main(task)
    Path(task_path).with_suffix(f".out{rank}.pkl").write_bytes(pickle.dumps(out))


def table(per_layer: float, head: float, links: dict, layers: int) -> None:
    from worker.split.schedule import simulate

    print(f"\nsimulated efficiency (worker.split.schedule.simulate), a model of {layers} such layers split evenly:")
    print("| K | link | M = 8 | M = 32 | M = 128 | M = 1024 |\n|---|---|---:|---:|---:|---:|")
    for k in (2, 4, 8):
        stages = [per_layer * (layers // k + (r < layers % k)) for r in range(k)]
        stages[-1] += head
        for name, link in links.items():
            # a send holds its rank until the next one has the state (no overlap): the link is in the sender's stage,
            # so the hand-over itself adds nothing more
            sending = [t + link * (r < k - 1) for r, t in enumerate(stages)]
            cells = " | ".join(f"{simulate(sending, 0.0, m) * sum(stages) / sum(sending):.3f}" for m in (8, 32, 128, 1024))
            print(f"| {k} | {name} ({link * 1e3:.2f} ms) | {cells} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--sim-layers", type=int, default=32)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--trips", type=int, default=50)
    p.add_argument("--task", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.task:
        return _child(args.task, args.rank)
    from testbed.models import write_model
    from worker.split import free_address

    folder = Path(tempfile.mkdtemp(prefix="orchard-bench-sim-"))
    try:
        model = write_model(folder / "model", hidden=args.hidden, layers=args.layers, heads=8, kv_heads=4, intermediate=3 * args.hidden)
        task = {"model": str(model), "tokens": args.tokens, "batch": args.batch, "hidden": args.hidden, "repeat": args.repeat}
        stage = _run(task, folder, 1)[0]
        link = _run({**task, "trips": args.trips, "hostfile": [free_address("127.0.0.1") for _ in range(2)]}, folder, 2)[0]["link"]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    per_layer = stage["body"] / args.layers
    mac = stage["bytes"] / MAC_LINK[0] + MAC_LINK[1]
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; random llama hidden {args.hidden} x {args.layers} layers; "
          f"micro-batch {args.batch} x {args.tokens} tokens ({stage['bytes'] / 1e6:.2f} MB hidden state)")  # fmt: skip
    print(f"measured: a layer {per_layer * 1e3:.2f} ms, the head at the scored positions {stage['head'] * 1e3:.2f} ms "
          f"({stage['head'] / per_layer:.2f} layers), one hand-over on the loopback ring {link * 1e3:.2f} ms")  # fmt: skip
    table(per_layer, stage["head"], {"loopback, measured": link, "10 GbE": mac}, args.sim_layers)


if __name__ == "__main__":
    main()
