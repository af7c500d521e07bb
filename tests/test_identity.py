"""Model identity by full content: one changed byte anywhere in a weight or tokenizer file is a new model, and the
result cache computes everything again; unchanged files are not read again (the per-file digest memo)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from worker import identity
from worker.identity import Memo, file_digests, folder_identity, identity_files, memo_path
from worker.load import fingerprint

MiB = 1 << 20


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """A private memo per test."""
    monkeypatch.setenv("ORCHARD_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def big_model(tmp_path_factory) -> Path:
    """A llama whose weight file is > 2 MiB (6 MiB), so its middle lies outside the first and last MiB."""
    from testbed.models import write_model

    return write_model(tmp_path_factory.mktemp("models") / "llama-6mib", arch="llama", hidden=256, intermediate=512)


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def poke(path: Path, offset: int, value: int) -> int:
    """Overwrite one byte in place (same size, same inode), then set atime/mtime back; returns the old byte."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([value]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)
    return old


def middle_weight_byte(weights: Path) -> tuple[int, int, str]:
    """(offset, new value) of the most significant byte of the float32 in the middle of the file: set to 0x42,
    the weight becomes 32..128 (from ~1), so every number moves; and which tensor it is in."""
    data = weights.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    start = 8 + n
    mid = len(data) // 2
    offset = start + (mid - start) // 4 * 4 + 3
    assert MiB < offset < len(data) - MiB  # beyond what a first/last-MiB fingerprint reads
    header = json.loads(data[8:start])
    name = next(k for k, v in header.items() if k != "__metadata__" and v["data_offsets"][0] <= offset - start < v["data_offsets"][1])
    assert header[name]["dtype"] == "F32" and data[offset] != 0x42
    return offset, 0x42, name


def middle_whitespace(path: Path) -> int:
    """Offset of an indentation space near the middle of a pretty-printed JSON file (a tab keeps it valid JSON)."""
    text = path.read_bytes()
    return text.index(b"\n  ", len(text) // 2) + 1


# --- the identity ----------------------------------------------------------------------------------


def test_one_byte_in_the_middle_of_the_weights_or_tokenizer_changes_the_identity(big_model, tmp_path):
    model = copy_model(big_model, tmp_path / "m")
    original = fingerprint(model)
    assert original == fingerprint(model) and len(original) == 32
    weights = model / "model.safetensors"
    offset, value, _ = middle_weight_byte(weights)
    old = poke(weights, offset, value)
    changed = fingerprint(model)
    assert changed != original
    poke(weights, offset, old)  # the same bytes again: the same model
    assert fingerprint(model) == original

    tokenizer = model / "tokenizer.json"
    at = middle_whitespace(tokenizer)
    poke(tokenizer, at, ord("\t"))
    json.loads(tokenizer.read_text())  # still a valid tokenizer file
    assert fingerprint(model) not in (original, changed)
    poke(tokenizer, at, ord(" "))
    assert fingerprint(model) == original


def test_every_file_that_changes_a_number_is_in_the_identity(llama_path, tmp_path):
    model = copy_model(llama_path, tmp_path / "m")
    (model / "chat_template.jinja").write_text("{{ messages }}")
    (model / "additional_chat_templates").mkdir()
    (model / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
    (model / "tokenizer.model").write_bytes(b"sentencepiece")
    (model / "merges.txt").write_text("a b\n")
    (model / "README.md").write_text("# a model card")
    (model / ".gitattributes").write_text("*.safetensors filter=lfs")
    (model / ".cache").mkdir()
    (model / ".cache" / "x.json").write_text("{}")
    names = [p.relative_to(model).as_posix() for p in identity_files(model)]
    assert names == sorted(names)
    assert set(names) == {
        "additional_chat_templates/tool_use.jinja", "chat_template.jinja", "config.json", "generation_config.json",
        "merges.txt", "model.safetensors", "special_tokens_map.json", "tokenizer.json", "tokenizer.model",
        "tokenizer_config.json",
    }  # fmt: skip
    before = fingerprint(model)
    for name in names:
        f = model / name
        data = f.read_bytes()
        f.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # the last byte
        assert fingerprint(model) != before, name
        f.write_bytes(data)
    assert fingerprint(model) == before
    (model / "README.md").write_text("# another card")
    assert fingerprint(model) == before  # a model card changes no number
    (model / "model.safetensors").rename(model / "model-00001-of-00001.safetensors")
    assert fingerprint(model) != before  # names are in it too
    # per-file digests are the files' plain sha256
    digests = dict((name, (size, d)) for name, size, d in file_digests(model))
    data = (model / "config.json").read_bytes()
    assert digests["config.json"] == (len(data), hashlib.sha256(data).hexdigest())


def test_an_adapter_folder_is_identified_by_content(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"fine_tune_type": "lora"}')
    (adapter / "adapters.safetensors").write_bytes(bytes(3 * MiB))
    before = fingerprint(adapter)
    poke(adapter / "adapters.safetensors", 3 * MiB // 2, 1)
    assert fingerprint(adapter) != before


def test_workers_with_different_model_bytes_are_refused(llama_path, tmp_path):
    from cluster.facts import mismatch

    a = copy_model(llama_path, tmp_path / "a")
    b = copy_model(llama_path, tmp_path / "b")
    weights = b / "model.safetensors"
    size = weights.stat().st_size
    poke(weights, size // 2, weights.read_bytes()[size // 2] ^ 0xFF)
    base = {"hostname": "mac1", "python": "3.11.7", "mlx": "1", "mlx-lm": "1", "ray": "2"}
    same = [{**base, "model_files": fingerprint(a)}, {**base, "hostname": "mac2", "model_files": fingerprint(llama_path)}]
    assert mismatch(same) is None
    mixed = [same[0], {**base, "hostname": "mac2", "model_files": fingerprint(b)}]
    assert "workers disagree on model_files" in mismatch(mixed)


def test_the_identity_reaches_every_cache_key(llama_path, tmp_path):
    """What the driver puts in the result cache's keys: another byte in the weights, another key for every kind."""
    from driver.lm.cache import job_prefix, key, identity as cache_identity
    from worker.generate import GenRequest
    from worker.spec import Job

    model = copy_model(llama_path, tmp_path / "m")

    def ident():  # the shape driver.lm.mlx_ray builds: the driver's identity dict plus the workers' model_files
        files = fingerprint(model)
        return cache_identity({"model": str(model), "revision": None, "adapter": None, "files": files,
                               "dtype": None, "max_length": 512, "weights": files})  # fmt: skip

    before = ident()
    weights = model / "model.safetensors"
    middle = weights.stat().st_size // 2
    old = poke(weights, middle, weights.read_bytes()[middle] ^ 1)
    after = ident()
    assert after != before
    for kind, request in [("loglikelihood", ((1, 2), (3,))), ("generate", GenRequest((1, 2))), ("capture", ((1, 2), -1))]:
        job = Job(kind=kind)
        assert job_prefix(after, job) != job_prefix(before, job)
        assert key(job_prefix(after, job), kind, request) != key(job_prefix(before, job), kind, request)
    poke(weights, middle, old)
    assert ident() == before  # the same bytes: the same keys, served from the cache


# --- the memo --------------------------------------------------------------------------------------


@pytest.fixture
def reads(monkeypatch):
    """Counts full-content reads, per file name; files count as settled at once (no racy window)."""
    seen: list[str] = []
    real = identity.sha256_file

    def counting(path):
        seen.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(identity, "sha256_file", counting)
    monkeypatch.setattr(identity, "RACY_NS", -(10**12))
    return seen


def test_a_second_call_reads_nothing_and_a_changed_stat_reads_that_file_again(big_model, tmp_path, reads, home):
    model = copy_model(big_model, tmp_path / "m")
    first = fingerprint(model)
    assert sorted(reads) == sorted(p.name for p in identity_files(model))
    reads.clear()
    assert fingerprint(model) == first and reads == []  # remembered: nothing read
    assert memo_path() == home / "file-hashes.sqlite" and memo_path().exists()
    weights = model / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # mtime only: read again, same digest
    assert fingerprint(model) == first and reads == ["model.safetensors"]
    reads.clear()
    copy = tmp_path / "copy.safetensors"
    shutil.copy2(weights, copy)
    os.replace(copy, weights)  # same bytes, size and mtime, another inode
    assert fingerprint(model) == first and reads == ["model.safetensors"]
    reads.clear()
    offset, value, _ = middle_weight_byte(weights)
    poke(weights, offset, value)  # same size, inode and mtime: only the ctime tells
    assert fingerprint(model) != first and reads == ["model.safetensors"]


def test_a_large_file_is_hashed_once(tmp_path, monkeypatch):
    """A 256 MiB sparse weight file: the first call reads it all, the next ones take no time."""
    monkeypatch.setattr(identity, "RACY_NS", -(10**12))  # settled at once (else: 2 s after its last change)
    model = tmp_path / "sparse"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with open(model / "model.safetensors", "wb") as f:
        f.truncate(256 * MiB)
    t = time.perf_counter()
    first = fingerprint(model)
    cold = time.perf_counter() - t
    t = time.perf_counter()
    assert fingerprint(model) == first
    warm = time.perf_counter() - t
    assert warm < 0.05 < cold and warm < cold / 10, (cold, warm)


def test_a_file_changed_a_moment_ago_is_not_remembered(llama_path, tmp_path, monkeypatch):
    seen: list[str] = []
    real = identity.sha256_file
    monkeypatch.setattr(identity, "sha256_file", lambda p: seen.append(Path(p).name) or real(p))
    model = copy_model(llama_path, tmp_path / "m")  # every ctime is now
    fingerprint(model)
    seen.clear()
    fingerprint(model)
    assert "model.safetensors" in seen  # within the racy window: read again rather than trusted


def test_a_corrupt_or_foreign_memo_is_set_aside_and_rebuilt(llama_path, tmp_path, reads, home):
    model = copy_model(llama_path, tmp_path / "m")
    expected = fingerprint(model)
    memo_path().unlink()
    for junk in ("wal", "shm"):
        Path(f"{memo_path()}-{junk}").unlink(missing_ok=True)
    memo_path().write_bytes(b"this is not a database" * 100)
    reads.clear()
    assert fingerprint(model) == expected and reads  # recomputed
    reads.clear()
    assert fingerprint(model) == expected and reads == []  # and remembered in a fresh memo
    assert any(p.name.startswith("file-hashes.sqlite.corrupt-") for p in home.iterdir())
    for p in home.iterdir():
        p.unlink()
    with sqlite3.connect(memo_path()) as db:  # another program's table of the same name
        db.execute("CREATE TABLE files (name TEXT)")
    reads.clear()
    assert fingerprint(model) == expected and reads
    reads.clear()
    assert fingerprint(model) == expected and reads == []
    # a wrong value stored under the right stat facts is not a valid digest: ignored
    with sqlite3.connect(memo_path()) as db:
        db.execute("UPDATE files SET sha256 = 'bad'")
    assert fingerprint(model) == expected


def test_an_unusable_memo_location_only_costs_time(llama_path, tmp_path, monkeypatch, reads):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("ORCHARD_HOME", str(blocker))  # mkdir fails: no memo
    expected = folder_identity(llama_path, Memo(tmp_path / "elsewhere.sqlite"))
    reads.clear()
    assert fingerprint(llama_path) == expected and reads
    reads.clear()
    assert fingerprint(llama_path) == expected and reads  # nothing remembered, nothing broken


def test_concurrent_writers_agree(big_model, tmp_path, home):
    model = copy_model(big_model, tmp_path / "m")
    code = "import sys; from worker import identity; identity.RACY_NS = -10**12; print(identity.folder_identity(sys.argv[1]))"
    root = Path(__file__).resolve().parents[1]
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(model)], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    assert {o.strip() for o, _ in outs} == {fingerprint(model)}
    with sqlite3.connect(memo_path()) as db:
        rows = db.execute("SELECT path FROM files").fetchall()
    assert sorted(Path(r[0]).name for r in rows) == sorted(p.name for p in identity_files(model))


# --- end to end: the result cache of a real mlx-ray run ---------------------------------------------


@pytest.fixture(scope="module")
def ray_session():
    """This process's Ray: the session's loopback cluster when one is up, else an embedded one (1 `mlx` unit)."""
    import logging

    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, resources={"mlx": 1}, logging_level=logging.WARNING)
    yield ray
    if started:
        ray.shutdown()


def test_stale_weights_or_tokenizer_are_never_served_from_the_result_cache(ray_session, big_model, tmp_path):
    from lm_eval.api.instance import Instance

    import driver  # noqa: F401  registers the models
    from driver.lm.mlx_ray import MLXRayLM

    model = copy_model(big_model, tmp_path / "m")
    cache = tmp_path / "cache"
    pairs = [("The river and the king", " went to war"), ("Question: what is water?\nAnswer:", " energy"), ("a", " b c")]
    ll = [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]
    gen = [Instance("generate_until", {}, ("Once upon a time", {"until": ["\n"], "max_gen_toks": 6}), 0)]

    def run():
        lm = MLXRayLM(pretrained=str(model), workers=1, cache=str(cache), batch_size=4)
        try:
            out = [tuple(r) for r in lm.loglikelihood(ll)], lm.generate_until(gen)  # (cached ones are lists)
            info = lm.executor.info()
            return out, info["requests_cached"], sum(info["requests_computed"].values()), lm.identity["files"]
        finally:
            lm.executor.close()

    first, cached, computed, ident = run()
    assert (cached, computed) == (0, 4)
    again, cached, computed, _ = run()
    assert again == first and (cached, computed) == (4, 0)  # the cache serves an unchanged model

    weights = model / "model.safetensors"
    offset, value, tensor = middle_weight_byte(weights)
    old = poke(weights, offset, value)
    stale, cached, computed, changed = run()
    assert (cached, computed) == (0, 4) and changed != ident, tensor  # everything computed again
    assert all(abs(a[0] - b[0]) > 1e-3 for a, b in zip(stale[0], first[0])), (stale, first)  # on the new weights
    poke(weights, offset, old)

    tokenizer = model / "tokenizer.json"
    poke(tokenizer, middle_whitespace(tokenizer), ord("\t"))  # same tokenizer, other bytes
    same, cached, computed, changed = run()
    assert (cached, computed) == (0, 4) and changed != ident
    assert same == first  # recomputed, and the numbers are the original weights' again
