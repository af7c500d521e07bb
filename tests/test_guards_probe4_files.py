"""Outputs readable as the umask says (issue 38.3): every output goes through one atomic writer,
driver.checks.files.write_atomic(_with), whose temp file is created 0666 less the umask (mkstemp's 0600 made sweep
and vector outputs unreadable to the group), and which leaves nothing behind when the write fails."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import numpy as np
import pytest

from driver.checks.files import write_atomic, write_atomic_with
from driver.steering.vectors import write_vectors

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(params=[0o022, 0o027, 0o077])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_an_output_has_the_mode_open_would_give_it(tmp_path, umask):
    (tmp_path / "plain").write_text("x")  # what open() gives under this umask
    out = write_atomic(tmp_path / "deep" / "er" / "summary.md", "text")
    assert out.read_text() == "text" and _mode(out) == _mode(tmp_path / "plain") == 0o666 & ~umask
    write_atomic(out, b"bytes")  # replacing keeps the umask's mode too
    assert out.read_bytes() == b"bytes" and _mode(out) == 0o666 & ~umask


def test_a_vector_file_is_readable_as_the_umask_says(tmp_path, umask):
    out = write_vectors(tmp_path / "v.safetensors", {"resid_post.0": np.ones(4)}, {"model": "m"})
    assert _mode(out) == 0o666 & ~umask


def test_a_writer_that_makes_its_own_file_gets_the_umask_s_mode(tmp_path, umask):
    from safetensors.numpy import save_file

    out = write_atomic_with(tmp_path / "t.safetensors", lambda tmp: save_file({"x": np.ones(2, np.float32)}, str(tmp)))
    assert _mode(out) == 0o666 & ~umask


def test_a_failed_write_leaves_the_old_output_and_no_temp_file(tmp_path):
    out = write_atomic(tmp_path / "results.csv", "old")

    def half(tmp):
        Path(tmp).write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomic_with(out, half)
    assert out.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["results.csv"]


PRIVATE = {"driver/checks/files.py",  # the writer
           "driver/checks/tasks.py"}  # the task-name memo: a private cache in ~/.orchard, not an output


def test_no_runtime_module_writes_an_output_its_own_way():
    """mkstemp (0600) and a bare os.replace are the writer's alone; the rooms below the driver keep their own
    (worker.staged: the staged-model store, cluster: the token and Ray's state), which are not user outputs."""
    own = re.compile(r"mkstemp|os\.replace\(|NamedTemporaryFile\(")
    found = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "driver").rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if own.search(line) and p.relative_to(ROOT).as_posix() not in PRIVATE]  # fmt: skip
    assert found == []
