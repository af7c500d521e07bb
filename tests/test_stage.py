"""`driver stage` on a 3-node loopback cluster: each node has its own ORCHARD_HOME (its raylet's environment,
as each Mac has its own home), so each node's store is a separate folder on this one machine."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from cluster.stage import StageNode, stage
from conftest import NODE
from driver.cli import main
from worker.identity import folder_identity
from worker.staged import PIECE, STATE, StageError, content_id, manifest, resolve, staged_path

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the node classes below travel by value
SMALL = 64 << 10  # pieces of 64 KiB: the ~6 MB test model is ~100 pieces


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Three `mlx` nodes, node i's ORCHARD_HOME is roots[i]. A session cluster this process was connected to (the
    shared `ray_cluster` fixture) is left for the time of this module and joined again after."""
    from ray.cluster_utils import Cluster

    previous = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    if previous:
        ray.shutdown()
    roots = [tmp_path_factory.mktemp(f"node{i}") for i in range(3)]
    env = [{"env_vars": {"ORCHARD_HOME": str(r)}} for r in roots]
    c = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False, **env[0]})
    for e in env[1:]:
        c.add_node(**NODE, **e)
    c.wait_for_nodes()
    ray.init(address=c.address, logging_level=logging.WARNING, log_to_driver=False)
    yield c.address, [r / "models" for r in roots]
    ray.shutdown()
    c.shutdown()
    if previous:
        ray.init(address=previous, logging_level=logging.WARNING)


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    from testbed.models import write_model

    return write_model(tmp_path_factory.mktemp("src") / "tiny", hidden=256, layers=2, intermediate=512)


@pytest.fixture
def fresh_model(base_model, tmp_path) -> Path:
    """The base model with one config changed: another content id, so nothing of it is staged yet."""
    path = tmp_path / "fresh"
    shutil.copytree(base_model, path)
    (path / "generation_config.json").write_text(f'{{"test": "{tmp_path.name}"}}')
    return path


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_on_every_node(report, source: Path, roots: list[Path]) -> None:
    for root in roots:
        folder = staged_path(report.content_id, root=root)
        for e in manifest(source):
            assert sha(folder / e["path"]) == e["sha256"] == sha(source / e["path"])
        assert folder_identity(folder) == folder_identity(source)  # the result cache sees the same model


def by_folder(report) -> dict[str, object]:
    return {str(Path(n.folder).parents[1]): n for n in report.nodes}


def test_files_arrive_on_every_node_and_a_second_run_moves_nothing(cluster, base_model):
    address, roots = cluster
    first = stage(str(base_model), piece_size=SMALL)
    files, total = len(manifest(base_model)), sum(e["size"] for e in manifest(base_model))
    assert len(first.nodes) == 3 and len({n.node_id for n in first.nodes}) == 3
    assert sorted(by_folder(first)) == sorted(str(r.parent) for r in roots)  # one store per node
    assert all(n.files_sent == files and n.bytes_sent == total for n in first.nodes)
    assert_on_every_node(first, base_model, roots)
    again = stage(str(base_model), piece_size=SMALL)
    assert again.content_id == first.content_id
    assert all(n.bytes_sent == 0 and n.pieces_sent == 0 and n.files_kept == files for n in again.nodes)


def test_a_damaged_finished_file_costs_one_piece(cluster, base_model):
    address, roots = cluster  # the first test staged base_model everywhere
    cid = content_id(manifest(base_model))
    weights = staged_path(cid, root=roots[1]) / "model.safetensors"
    with open(weights, "r+b") as f:  # flip one byte inside piece 3
        f.seek(3 * SMALL + 100)
        byte = f.read(1)
        f.seek(3 * SMALL + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    report = stage(str(base_model), piece_size=SMALL)
    again = by_folder(report)
    assert [again[str(r.parent)].pieces_sent for r in roots] == [0, 1, 0]
    assert again[str(roots[1].parent)].bytes_sent == SMALL
    assert_on_every_node(report, base_model, roots)


class Garbling(StageNode):
    """Every node receives its first piece damaged (as a bad link or disk read would)."""

    def write(self, rel, index, data, digest):
        if not getattr(self, "garbled", False):
            self.garbled, data = True, bytes([data[0] ^ 0xFF]) + bytes(data[1:])
        return super().write(rel, index, data, digest)


def test_a_piece_damaged_on_the_way_is_detected_and_sent_again(cluster, fresh_model):
    address, roots = cluster
    report = stage(str(fresh_model), piece_size=SMALL, node_cls=Garbling)
    assert_on_every_node(report, fresh_model, roots)


class CrashAfter(StageNode):
    """The node's process dies when the 6th piece arrives: 5 pieces are on its disk."""

    def write(self, rel, index, data, digest):
        self.count = getattr(self, "count", 0) + 1
        if self.count > 5:
            os._exit(1)
        return super().write(rel, index, data, digest)


def test_an_interrupted_transfer_resumes_and_rechecks_what_it_kept(cluster, fresh_model):
    address, roots = cluster
    with pytest.raises(StageError, match=r"was lost while staging fresh after \d+ pieces \(.*\): rerun `driver stage` to resume"):
        stage(str(fresh_model), piece_size=SMALL, node_cls=CrashAfter)
    partial = next(roots[2].glob(f"fresh-*/{STATE}/partial/model.safetensors"))
    with open(partial, "r+b") as f:  # damage piece 1 of the weights, one of the 5 pieces node 2 kept
        f.seek(SMALL + 7)
        byte = f.read(1)
        f.seek(SMALL + 7)
        f.write(bytes([byte[0] ^ 0x01]))
    total = sum(-(-e["size"] // SMALL) for e in manifest(fresh_model))
    report = stage(str(fresh_model), piece_size=SMALL)
    sent = by_folder(report)
    assert [sent[str(r.parent)].pieces_sent for r in roots] == [total - 5, total - 5, total - 4]
    assert_on_every_node(report, fresh_model, roots)


class TinyDisk(StageNode):
    def free_bytes(self) -> int:
        return 1000


def test_a_node_short_of_disk_space_is_refused_in_one_line(cluster, fresh_model):
    with pytest.raises(StageError) as e:
        stage(str(fresh_model), piece_size=SMALL, node_cls=TinyDisk)
    message = str(e.value)
    assert "\n" not in message
    assert "not enough disk space to stage fresh:" in message and "MB needed in" in message and "0.0 MB free" in message


class HalfDisk(StageNode):
    """A disk with room for half the model: enough for a few missing pieces, not for the whole model."""

    def free_bytes(self) -> int:
        return sum(e["size"] for e in self.entries.values()) // 2


def test_a_mostly_staged_node_needs_space_only_for_its_missing_pieces(cluster, base_model):
    address, roots = cluster  # the first test staged base_model everywhere
    folder = staged_path(content_id(manifest(base_model)), root=roots[0])
    (folder / "config.json").unlink()
    with open(folder / "model.safetensors", "r+b") as f:  # one damaged piece: 64 KiB to resend
        f.seek(2 * SMALL)
        f.write(b"\x00" * 8)
    report = stage(str(base_model), piece_size=SMALL, node_cls=HalfDisk)
    assert [by_folder(report)[str(r.parent)].files_sent for r in roots] == [2, 0, 0]
    assert_on_every_node(report, base_model, roots)


_WRITER = """
import sys
from pathlib import Path
from worker import staged

source, folder, piece = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
entries = staged.manifest(source)
cid = staged.content_id(entries)
for rel, indices in staged.needs(folder, entries, cid, piece).items():
    entry = next(e for e in entries if e["path"] == rel)
    for i in indices:
        with open(source / rel, "rb") as f:
            f.seek(i * piece)
            data = f.read(piece)
        assert staged.write_piece(folder, entry, i, data, __import__("hashlib").sha256(data).hexdigest(), piece)
staged.finish(folder, cid)
print("ok")
"""


def test_several_processes_staging_into_one_folder_at_once_all_succeed(base_model, tmp_path):
    """The node's side of staging from 4 processes at once (4 nodes on one disk, or 4 `driver stage` runs): each
    asks what is missing, writes every piece it was told to, and finishes; every file ends up whole and verified."""
    import subprocess

    cid = content_id(manifest(base_model))
    folder = tmp_path / "store" / f"tiny-{cid[:16]}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "ORCHARD_HOME": str(tmp_path / "oh")}
    argv = [sys.executable, "-c", _WRITER, str(base_model), str(folder), str(16 << 10)]
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(4)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [o.strip().splitlines()[-1] for o in outputs] == ["ok"] * 4, "\n".join(outputs)[-3000:]
    assert staged_path(cid, root=folder.parent) == folder
    for e in manifest(base_model):
        assert sha(folder / e["path"]) == e["sha256"]
    assert not list((folder / STATE).rglob("*.tmp")) and not [p for p in (folder / STATE / "partial").rglob("*") if p.is_file()]


def test_cli_stages_and_prints_one_line_per_node(cluster, fresh_model):
    address, roots = cluster
    result = CliRunner().invoke(main, ["stage", "--model", str(fresh_model), "--address", address])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[:2] == [  # what it does, on stderr (stdout: the report)
        f"driver: using the Ray cluster this process is connected to, at {address}, to stage {fresh_model}",
        f"driver: staging {fresh_model} on every `mlx` node (pieces of at most 64 MiB, each checked by sha256)"]
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 4 and all(" sent 6 files (" in line and "MB/s), kept 0" in line for line in lines[:3])
    assert lines[3].startswith("staged fresh (6 files, ") and " on 3 nodes in " in lines[3] and " as staged:" in lines[3]
    cid = lines[3].rsplit("staged:", 1)[1]
    assert cid == content_id(manifest(fresh_model))
    assert all(staged_path(cid, root=r).is_dir() for r in roots)


@pytest.mark.parametrize(
    "model, message",
    [("/no/such/model", "Error: model path does not exist: /no/such/model"),
     ("orchard-test/no-such-repo", "Error: cannot fetch 'orchard-test/no-such-repo' from the Hugging Face Hub")],
)  # fmt: skip
def test_cli_refuses_a_bad_model_in_one_line(cluster, model, message):
    result = CliRunner().invoke(main, ["stage", "--model", model, "--address", cluster[0]])
    assert result.exit_code == 1
    assert result.output.startswith(message) and len(result.output.strip().splitlines()) == 1


def test_the_hub_path_offline_is_a_note_not_a_crash(base_model, tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHARD_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    node = StageNode("repo", "0" * 64, manifest(base_model), PIECE)
    note = node.from_hub("orchard-test/no-such-repo", None)
    assert note.startswith("no Hub download on ") and "\n" not in note


def test_a_model_not_staged_here_is_one_line(tmp_path):
    with pytest.raises(StageError, match=r"does not hold staged:0123456789abcdef complete under .*: run `driver stage"):
        staged_path("0123456789abcdef" * 4, root=tmp_path)
    with pytest.raises(StageError, match="is not a staged model id"):
        resolve("staged:../../etc")
    assert resolve("mlx-community/some-model") is None


def test_a_run_with_stage_loads_each_nodes_own_copy_and_scores_the_same(cluster, fresh_model):
    """`driver run --stage` (model_args stage=true): the model is staged, then each worker loads its node's copy."""
    from lm_eval.api.instance import Instance

    from driver.lm.mlx import MLXLM
    from driver.lm.mlx_ray import MLXRayLM

    address, roots = cluster
    requests = [
        Instance("loglikelihood", {}, (f"Story {i}: once upon a time", " there was"), i) for i in range(6)
    ]
    staged_lm = MLXRayLM(pretrained=str(fresh_model), stage=True, address=address, workers=3, batch_size=2)
    try:
        paths = sorted(f["model_path"] for f in staged_lm.executor.facts)
        got = staged_lm.loglikelihood(requests, disable_tqdm=True)
    finally:
        staged_lm.executor.close()
    cid = content_id(manifest(fresh_model))
    assert paths == sorted(str(staged_path(cid, root=r)) for r in roots)  # every worker: its own node's copy
    want = MLXLM(pretrained=str(fresh_model), batch_size=2).loglikelihood(requests, disable_tqdm=True)
    assert max(abs(x - y) for (x, _), (y, _) in zip(got, want)) < 1e-4  # float32, other batch layouts
