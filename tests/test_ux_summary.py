"""A run's summary lists every worker: the printout and summary_*.json name each one with its requests, an idle
one with 0 and why it got none (one document of orchard_mc is one chunk: one worker computes, two stay idle)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from driver.cli import main


def test_every_worker_is_listed_with_its_requests_idle_ones_too(ray_cluster, llama_path, tasks_dir, tmp_path):
    result = CliRunner().invoke(main, [
        "run", "--model", str(llama_path), "--include-path", str(tasks_dir), "--tasks", "orchard_mc", "--limit", "1",
        "--workers", "3", "--address", ray_cluster.address, "--output-path", str(tmp_path)])  # fmt: skip
    assert result.exit_code == 0, result.output
    (path,) = tmp_path.rglob("summary_*.json")
    rows = json.loads(path.read_text())["per_worker"]
    assert [name.split("@")[0] for name in rows] == ["w0", "w1", "w2"], rows
    assert sum(r["requests"] for r in rows.values()) == 4
    idle = [name for name, r in rows.items() if r["requests"] == 0]
    assert idle, "one document is one chunk: some worker is idle"
    assert all(rows[n]["why_none"].startswith("idle") for n in idle)
    listed = [line.split()[0] for line in result.stdout.splitlines() if line.startswith("  w")]
    assert listed == list(rows), result.stdout
    for name in idle:
        assert any(line.split()[:1] == [name] and "(idle: " in line for line in result.stdout.splitlines()), result.stdout
