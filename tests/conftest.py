"""Shared fixtures: tiny random-weight models of two architectures and offline lm-eval tasks."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

# Offline, on loopback, quiet: set before lm-eval / datasets / Ray are imported by any test module.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

# A shell that starts the suite in the background (`(pytest &)`, no job control) has it ignore SIGINT, and so would
# every process it starts: the Ctrl-C tests (a run interrupted and resumed, Ray's start interrupted) need Ctrl-C.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
MMLU_CACHE = SHARED / "data" / "hf-datasets" / "cais___mmlu"

# A private, writable datasets cache (datasets reads the variable when it is imported, so set it here),
# holding a copy of the prepared offline `cais/mmlu` cache when ../shared has one.
_cache = Path(tempfile.mkdtemp(prefix="orchard-hf-datasets-"))
os.environ["HF_DATASETS_CACHE"] = str(_cache)
os.environ.setdefault("ORCHARD_HOME", str(_cache / "orchard-home"))  # the file-hash memo: not the user's ~/.cache
if MMLU_CACHE.is_dir():
    shutil.copytree(MMLU_CACHE, _cache / MMLU_CACHE.name)


# The files that take longest, longest first (seconds summed over their tests, the suite's --durations on this box):
# pytest-xdist (--dist loadfile --no-loadscope-reorder) hands a process one whole file at a time in collection
# order, so these start first and the many short files fill the end, instead of a long file starting last.
SLOW_FILES = [
    "test_cli.py", "test_sweep.py", "test_groups.py", "test_nodes.py", "test_cluster.py", "test_fresh_install.py",
    "test_sweep_prompting.py", "test_patch_worker.py", "test_sweep_evidence.py", "test_sweep_judge.py", "test_ux_probe4.py",
    "test_patch_cli.py", "test_guards_probe2_sigint.py", "test_guards_probe4_ring.py",
    "test_steering_run.py", "test_errors.py", "test_steer_sites.py", "test_architectures.py", "test_stage.py",
    "test_grid.py", "test_pipeline_generate.py", "test_rerun.py", "test_steer_ops.py", "test_pipeline_grid.py",
    "test_cli_faults.py", "test_vectors.py", "test_generate_prefix.py", "test_sweep_features.py", "test_steer_condition_groups.py",
]  # fmt: skip


def pytest_collection_modifyitems(items):
    """The slow files first (SLOW_FILES' order), then the others in their own order; tests keep theirs in a file."""
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


NO_TORCH = Path(__file__).resolve().parents[1] / "testbed" / "notorch"  # its sitecustomize hides PyTorch


@pytest.fixture(scope="session", autouse=True)
def _children_without_torch():
    """Every process the tests start (Ray's workers, `driver` subprocesses, ring ranks) runs without PyTorch, as on a
    user's install, where torch is absent (a test extra: lm-eval's hf oracle, which runs in this process). Else
    transformers imports it in each: a Ray worker's start took 4.4 s of CPU with it, 1.9 s without. Set in the process
    that runs the tests (a fixture), never in pytest-xdist's controller, whose worker processes need torch."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(NO_TORCH), *([before] if before else [])])
    yield
    os.environ.pop("PYTHONPATH") if before is None else os.environ.__setitem__("PYTHONPATH", before)


@pytest.fixture(scope="session", autouse=True)
def _lm_eval_index_once():
    """lm-eval's index of its own task YAMLs (~14,000 of them, 6 s of CPU), which every TaskManager builds (every
    `driver run`, in-process here), is built once per process; the include paths are indexed each time, as lm-eval
    does. Its entries are never changed after the build (a task is made from its YAML file, read again, or from a
    deep copy of the entry's config), so one index serves every TaskManager."""
    from lm_eval.tasks import _index

    real, builtin, memo = _index.TaskIndex.build, Path(_index.__file__).parent, {}

    def build(paths, *, resolve_includes=True):
        paths = list(paths)
        if not paths or Path(paths[0]) != builtin:
            return real(paths, resolve_includes=resolve_includes)
        if resolve_includes not in memo:
            memo[resolve_includes] = real(paths[:1], resolve_includes=resolve_includes)
        return {**memo[resolve_includes], **real(paths[1:], resolve_includes=resolve_includes)}  # later paths win

    _index.TaskIndex.build = staticmethod(build)
    yield
    _index.TaskIndex.build = staticmethod(real)


@pytest.fixture(scope="session", autouse=True)
def _remove_datasets_cache():
    yield
    shutil.rmtree(_cache, ignore_errors=True)


@pytest.fixture(scope="session")
def offline_mmlu() -> None:
    if not MMLU_CACHE.is_dir():
        pytest.skip("../shared/data/hf-datasets is absent: no offline MMLU")


@pytest.fixture(scope="session")
def llama_path(tmp_path_factory) -> Path:
    from testbed.models import write_model

    return write_model(tmp_path_factory.mktemp("models") / "tiny-llama", arch="llama")


@pytest.fixture(scope="session")
def gpt2_path(tmp_path_factory) -> Path:
    from testbed.models import write_model

    return write_model(tmp_path_factory.mktemp("models") / "tiny-gpt2", arch="gpt2", heads=4)


@pytest.fixture(scope="session", params=["llama", "gpt2"])
def model_path(request, llama_path, gpt2_path) -> Path:
    return {"llama": llama_path, "gpt2": gpt2_path}[request.param]


@pytest.fixture(scope="session")
def tasks_dir(tmp_path_factory) -> Path:
    from testbed.tasks import write_tasks

    return write_tasks(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="session")
def stories_path() -> Path:
    """The real TinyStories-260K model: it ships in examples/, so no test needs ../shared for it."""
    path = Path(__file__).resolve().parents[1] / "examples" / "stories260K"
    assert (path / "config.json").exists(), "examples/stories260K ships with the project"
    return path


@pytest.fixture(scope="session")
def story_plain(tmp_path_factory, ray_cluster) -> dict:
    """The unsplit `driver run` on the stories model and its tasks (test_cli._story_args), once, in this process on
    one worker of the session's cluster (the reference the grouped runs are compared with): {task: {doc: responses}}."""
    from test_cli import _story_args, _story_samples

    from testbed import inproc

    folder = tmp_path_factory.mktemp("story-plain")
    args = _story_args(folder, "plain")
    args[args.index("--address") + 1] = inproc.session_address()
    proc = inproc.driver(*args, cwd=folder)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _story_samples(folder / "plain")


NODE = {"num_cpus": 1, "resources": {"mlx": 1}, "node_ip_address": "127.0.0.1"}


@pytest.fixture(scope="session")
def ray_cluster():
    """Four loopback Ray nodes offering {"mlx": 1} each, like four Macs; this process is connected to it."""
    import logging

    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    for _ in range(3):
        c.add_node(**NODE)
    c.wait_for_nodes()
    ray.init(address=c.address, logging_level=logging.WARNING)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture
def ray_disconnected():
    """Not connected to Ray for the test (a test that Ray is not started): the session's cluster is joined again after."""
    from testbed.inproc import disconnected

    with disconnected():
        yield

