"""driver/steer.py: the steering spec file -> worker.spec.Steering, its record, and one-line errors. No models."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from driver.steering.spec import SpecFile, SteeringError, check, for_model, load_steering, model_shape
from worker.spec import OPS, POSITIONS, SITES, Intervention, Steering

V = np.array([3.0, 4.0, 0.0, 0.0, 0.0], dtype=np.float32)  # norm 5
W = np.array([0.5, -1.0, 2.0, 0.25, 1.0], dtype=np.float32)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """spec/ next to vecs/: relative paths in a spec start from the spec's own folder."""
    (tmp_path / "spec").mkdir()
    (tmp_path / "vecs").mkdir()
    np.save(tmp_path / "vecs" / "v.npy", V)
    save_file({"resid_pre.3": W, "resid_post.3": V, "resid_post.-1": W}, str(tmp_path / "vecs" / "all.safetensors"),
              metadata={"model": "tiny", "method": "mean_diff"})  # fmt: skip
    return tmp_path


YAML_SPEC = """\
interventions:
  - layer: 2
    vector: ../vecs/v.npy
    alpha: 4
  - layer: 3
    site: resid_pre
    op: clamp
    vector: {file: ../vecs/all.safetensors}
    alpha: -1.5
    positions: continuation
    normalize: true
"""

EXPECTED = Steering(
    interventions=(
        Intervention(layer=2, vector=tuple(V.tolist()), alpha=4.0),
        Intervention(layer=3, site="resid_pre", op="clamp", vector=tuple(W.tolist()), alpha=-1.5,
                     positions="continuation", normalize=True),
    )
)  # fmt: skip


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


def test_yaml_spec_loads_with_defaults_relative_paths_and_default_key(tree):
    run = load_steering(write(tree / "spec", "s.yaml", YAML_SPEC))
    assert run.steering == EXPECTED
    assert run.steering.interventions[0].site == "resid_post" and run.steering.interventions[0].positions == "all"


def test_json_spec_gives_the_same_steering_and_key(tree):
    yaml_run = load_steering(write(tree / "spec", "s.yml", YAML_SPEC))
    import yaml

    json_path = write(tree / "spec", "s.json", json.dumps(yaml.safe_load(YAML_SPEC)))
    json_run = load_steering(json_path)
    assert json_run.steering == yaml_run.steering == EXPECTED
    assert json_run.steering.key() == yaml_run.steering.key() != ""


def test_dict_spec_resolves_against_base_dir_or_cwd(tree, monkeypatch):
    spec = {"interventions": [{"layer": 3, "vector": {"file": "all.safetensors", "key": "resid_pre.3"}}]}
    assert load_steering(spec, base_dir=tree / "vecs").steering.interventions[0].vector == tuple(W.tolist())
    monkeypatch.chdir(tree / "vecs")
    from_cwd = load_steering({"interventions": [{"layer": 0, "vector": Path("v.npy")}]})
    assert from_cwd.steering.interventions[0].vector == tuple(V.tolist())
    assert load_steering(SpecFile.model_validate(spec)).steering.interventions[0].vector == tuple(W.tolist())


def test_record_carries_paths_hashes_norms_and_metadata(tree):
    spec_path = write(tree / "spec", "s.yaml", YAML_SPEC)
    record = load_steering(spec_path).record
    json.dumps(record)  # JSON-able as is
    assert record["source"] == str(spec_path) and record["source_sha256"] == sha(spec_path.read_bytes())
    assert record["spec"]["interventions"][1] == {
        "layer": 3, "site": "resid_pre", "op": "clamp", "vector": {"file": "../vecs/all.safetensors"},
        "alpha": -1.5, "positions": "continuation", "normalize": True,
    }  # as written: no defaults filled in  # fmt: skip
    npy, st = record["vectors"]
    assert npy == {
        "path": str(tree / "vecs" / "v.npy"), "key": None, "file_sha256": sha((tree / "vecs" / "v.npy").read_bytes()),
        "sha256": sha(V.tobytes()), "norm": 5.0, "length": 5, "metadata": None,
    }  # fmt: skip
    assert st["path"] == str(tree / "vecs" / "all.safetensors") and st["key"] == "resid_pre.3"
    assert st["file_sha256"] == sha((tree / "vecs" / "all.safetensors").read_bytes())
    assert st["sha256"] == sha(W.tobytes()) == EXPECTED.interventions[1].vector_sha256()
    assert st["metadata"] == {"model": "tiny", "method": "mean_diff"}


def test_float64_vectors_travel_as_float32(tree):
    np.save(tree / "vecs" / "d.npy", np.array([0.1, 0.2], dtype=np.float64))
    run = load_steering({"interventions": [{"layer": 0, "vector": "d.npy"}]}, base_dir=tree / "vecs")
    assert run.steering.interventions[0].vector == tuple(np.float32([0.1, 0.2]).tolist())
    assert run.record["vectors"][0]["sha256"] == run.steering.interventions[0].vector_sha256()


def test_empty_interventions_mean_unsteered(tree):
    run = load_steering(write(tree / "spec", "e.yaml", "interventions: []\n"))
    assert run.steering == Steering() and not run.steering and run.steering.key() == ""


def test_a_ready_steering_passes_through_with_a_record():
    run = load_steering(EXPECTED)
    assert run.steering is EXPECTED
    assert [v["sha256"] for v in run.record["vectors"]] == [iv.vector_sha256() for iv in EXPECTED.interventions]
    json.dumps(run.record)


def test_key_is_stable_and_changes_with_alpha_and_vector(tree):
    path = write(tree / "spec", "s.yaml", YAML_SPEC)
    key = load_steering(path).steering.key()
    assert load_steering(path).steering.key() == key
    other_alpha = write(tree / "spec", "a.yaml", YAML_SPEC.replace("alpha: 4", "alpha: 4.5"))
    assert load_steering(other_alpha).steering.key() != key
    bumped = V.copy()
    bumped[2] = 1e-3
    np.save(tree / "vecs" / "v.npy", bumped)
    assert load_steering(path).steering.key() != key


def test_check_resolves_negative_layers_and_validates_shape():
    s = Steering(interventions=(Intervention(layer=-1, vector=(1.0, 2.0)), Intervention(layer=1, vector=(1.0, 0.0))))
    resolved = check(s, 5, 2)
    assert [iv.layer for iv in resolved.interventions] == [4, 1]
    assert resolved.interventions[0].vector == (1.0, 2.0)
    assert check(s, None, None) == s  # unknown shape: the worker checks
    bad = Steering(interventions=(Intervention(layer=0, vector=(1.0, 2.0)), Intervention(layer=7, vector=(1.0, 2.0))))
    with pytest.raises(SteeringError) as e:
        check(bad, 5, 2)
    assert str(e.value) == (
        "interventions[1].layer: 7 is out of range for a model with 5 layers (use 0..4, or -5..-1 from the end)"
    )
    with pytest.raises(SteeringError, match=r"^interventions\[0\]\.layer: -6 is out of range"):
        check(Steering(interventions=(Intervention(layer=-6, vector=(1.0,)),)), 5, 1)
    with pytest.raises(SteeringError, match=r"^interventions\[0\]\.vector: has 2 values but the model's hidden size is 3 "):
        check(s, 5, 3)


def test_a_negative_layers_default_key_is_that_of_the_layer_it_resolves_to(tree):
    """docs/steering.md's example: `layer: -1` with `vector: {file: ...}` reads `resid_post.<n_layers - 1>`."""
    save_file({"resid_post.4": W, "resid_pre.3": V}, str(tree / "vecs" / "five.safetensors"))
    spec = {"interventions": [{"layer": -1, "op": "ablate", "vector": {"file": "five.safetensors"}, "normalize": True},
                              {"layer": -2, "site": "resid_pre", "vector": {"file": "five.safetensors"}}]}  # fmt: skip
    run = for_model(spec, {"num_hidden_layers": 5, "hidden_size": 5}, base_dir=tree / "vecs")
    assert [iv.layer for iv in run.steering.interventions] == [4, 3]
    assert [iv.vector for iv in run.steering.interventions] == [tuple(W.tolist()), tuple(V.tolist())]
    assert [v["key"] for v in run.record["vectors"]] == ["resid_post.4", "resid_pre.3"]
    with pytest.raises(SteeringError, match=r"interventions\[0\]\.layer: -6 is out of range for a model with 5 layers"):
        for_model({"interventions": [{"layer": -6, "vector": {"file": "five.safetensors"}}]},
                  {"num_hidden_layers": 5, "hidden_size": 5}, base_dir=tree / "vecs")  # fmt: skip


@pytest.mark.parametrize(
    "fields, dtype, message",
    [
        ({"alpha": 70000.0}, "float16", "interventions[0].alpha: alpha reaches 7e+04, which is inf in float16"),
        ({"alpha": 20000.0}, "float16", "interventions[0].alpha: alpha*vector reaches 8e+04, which is inf in float16"),
        ({"alpha": 1e38}, "bfloat16", "interventions[0].alpha: alpha*vector reaches 4e+38, which is inf in bfloat16"),
        ({"alpha": 3.0e38, "op": "clamp"}, "bfloat16", None),  # clamp writes alpha*u: finite
        ({"alpha": 1000.0}, "float32", None),
    ],
)
def test_values_are_checked_in_the_dtype_the_model_computes_in(tree, fields, dtype, message):
    config = {"num_hidden_layers": 2, "hidden_size": 5, "torch_dtype": dtype}
    spec = {"interventions": [{"layer": 0, "vector": "v.npy", **fields}]}
    if message is None:
        assert for_model(spec, config, base_dir=tree / "vecs").steering.interventions[0].alpha == fields["alpha"]
        return
    with pytest.raises(SteeringError) as e:
        for_model(spec, config, base_dir=tree / "vecs")
    assert message in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SteeringError, match="inf in float16"):  # model_args dtype=float16 on a float32 model
        for_model(spec, {**config, "torch_dtype": "float32"}, "float16", base_dir=tree / "vecs")


@pytest.mark.parametrize(
    "family, parallel_flag, refused",
    [("phi", None, True), ("cohere", None, True), ("gpt_neox", None, True), ("gpt_neox", False, False),
     ("stablelm", None, False), ("stablelm", True, True), ("llama", None, False)],
)
def test_resid_mid_on_a_parallel_block_is_refused_naming_family_and_site(tree, family, parallel_flag, refused):
    config = {"num_hidden_layers": 2, "hidden_size": 5, "model_type": family}
    if parallel_flag is not None:
        config["use_parallel_residual"] = parallel_flag
    spec = {"interventions": [{"layer": 0, "site": "resid_mid", "vector": "v.npy"}]}
    if not refused:
        assert for_model(spec, config, base_dir=tree / "vecs").steering.interventions[0].site == "resid_mid"
        return
    with pytest.raises(SteeringError) as e:
        for_model(spec, config, base_dir=tree / "vecs")
    assert str(e.value) == (f"steering spec (dict): interventions[0].site: the {family} block runs attention and MLP in "
                            "parallel on the same input, so it has no resid_mid: steer attn_out or mlp_out")  # fmt: skip
    spec["interventions"][0]["site"] = "attn_out"  # its branch outputs are there
    assert for_model(spec, config, base_dir=tree / "vecs").steering.interventions[0].site == "attn_out"


def test_model_shape_reads_hf_configs():
    assert model_shape({"num_hidden_layers": 24, "hidden_size": 896}) == (24, 896)
    assert model_shape({"n_layer": 12, "n_embd": 768}) == (12, 768)
    nested = {"model_type": "llava", "text_config": {"num_hidden_layers": 32, "hidden_size": 4096}}
    assert model_shape(nested) == (32, 4096)
    assert model_shape({"num_layers": 6, "d_model": 512}) == (6, 512)
    assert model_shape({}) == (None, None)


def iv(**fields) -> dict:
    return {"interventions": [{"layer": 0, "vector": "v.npy", **fields}]}


def prepare_bad_files(vecs: Path) -> None:
    np.save(vecs / "zeros.npy", np.zeros(5, dtype=np.float32))
    np.save(vecs / "nan.npy", np.array([1.0, np.nan, np.inf], dtype=np.float32))
    np.save(vecs / "big.npy", np.array([1e300], dtype=np.float64))  # inf as float32
    np.save(vecs / "huge.npy", np.full(5, 3e38, dtype=np.float32))  # finite in float32, its norm is not
    np.save(vecs / "2d.npy", np.ones((2, 5), dtype=np.float32))
    np.save(vecs / "ints.npy", np.arange(5))
    np.save(vecs / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.save(vecs / "empty.npy", np.zeros(0, dtype=np.float32))
    (vecs / "junk.npy").write_bytes(b"not an npy file")
    (vecs / "junk.safetensors").write_bytes(b"\x00\x01garbage")
    with open(vecs / "v.pt", "wb") as f:
        pickle.dump([1.0, 2.0], f)
    save_file({f"resid_post.{i}": V for i in range(12)}, str(vecs / "many.safetensors"))


# (spec as a dict, or YAML/JSON text with its suffix) -> fragments the one-line message must hold
ERROR_CASES = {
    "alpha not a number": (iv(alpha="strong"), ["interventions[0].alpha", "must be a number", "'strong'"]),
    "alpha yaml 1e3": (".yaml", "interventions:\n  - {layer: 0, vector: v.npy, alpha: 1e3}\n",
                       ["interventions[0].alpha", "'1e3' is text", "1.0e+3"]),
    "alpha nan": (iv(alpha=float("nan")), ["interventions[0].alpha", "finite number"]),
    "alpha inf yaml": (".yaml", "interventions:\n  - {layer: 0, vector: v.npy, alpha: .inf}\n",
                       ["interventions[0].alpha", "finite number"]),
    "alpha bool": (iv(alpha=True), ["interventions[0].alpha", "must be a number"]),
    "layer not int": (iv(layer="3"), ["interventions[0].layer", "must be an integer"]),
    "layer float": (iv(layer=1.5), ["interventions[0].layer", "must be an integer"]),
    "layer missing": ({"interventions": [{"vector": "v.npy"}]}, ["interventions[0].layer", "missing"]),
    "vector missing": ({"interventions": [{"layer": 0}]}, ["interventions[0].vector", "missing"]),
    "unknown op": (iv(op="multiply"), ["interventions[0].op", "'multiply'", ", ".join(OPS)]),
    "unknown site": (iv(site="attn_output"), ["interventions[0].site", ", ".join(SITES)]),
    "unknown positions": (iv(positions="first"), ["interventions[0].positions", ", ".join(POSITIONS)]),
    "normalize not bool": (iv(normalize="yes"), ["interventions[0].normalize", "true or false"]),
    "unknown field": (iv(alhpa=2), ["interventions[0].alhpa", "unknown field", "did you mean 'alpha'"]),
    "misspelt field": ({"interventions": [{"layer": 0, "vectr": "v.npy"}]},
                       ["interventions[0].vectr: unknown field (did you mean 'vector'?", "[and 1 more problem(s)]"]),
    "misspelt top field": ({"intervention": []}, ["intervention: unknown field (did you mean 'interventions'?"]),
    "unknown top field": ({"interventions": [], "name": "x"}, ["name: unknown field", "allowed: interventions"]),
    "unknown vector field": (iv(vector={"file": "all.safetensors", "layer": 3}),
                             ["interventions[0].vector.layer", "unknown field", "file, key"]),
    "vector inline list": (iv(vector=[1.0, 2.0]), ["interventions[0].vector", "path to a .npy file or {file"]),
    "vector ref without file": (iv(vector={"key": "resid_post.0"}), ["interventions[0].vector.file", "missing"]),
    "interventions missing": ({}, ["interventions: missing", "interventions: []"]),
    "interventions not a list": ({"interventions": 3}, ["interventions: must be a list"]),
    "intervention not a mapping": ({"interventions": ["v.npy"]}, ["interventions[0]: must be a mapping"]),
    "top level a list": (".yaml", "- layer: 0\n  vector: v.npy\n", ["must be a mapping with an `interventions:` list"]),
    "empty file": (".yaml", "", ["spec is empty", "interventions"]),
    "malformed yaml": (".yaml", "interventions:\n  - layer: [0,\n    vector: v.npy: x\n", ["malformed YAML at line 3"]),
    "malformed json": (".json", '{"interventions": [\n  {"layer": 0,}\n]}', ["malformed JSON at line 2"]),
    "wrong spec suffix": (".txt", "interventions: []", ["use a .yaml, .yml or .json file"]),
    "missing vector file": (iv(vector="nope.npy"),
                            ["interventions[0].vector", "nope.npy does not exist", "relative paths start from"]),
    "pickle file": (iv(vector="v.pt"), ["interventions[0].vector", "pickle", "save it as .npy or .safetensors"]),
    "pickle suffix in ref": (iv(vector={"file": "w.pth"}), ["interventions[0].vector.file", "pickle"]),
    "bin file": (iv(vector="pytorch_model.bin"), ["pickle", ".npy or .safetensors"]),
    "other suffix": (iv(vector="v.txt"), ["unsupported vector file", ".npy or .safetensors"]),
    "pickled npy": (iv(vector="obj.npy"), ["interventions[0].vector", "pickled data or Python objects", "numpy.save"]),
    "corrupt npy": (iv(vector="junk.npy"), ["interventions[0].vector", "junk.npy is a text file, not a .npy array", "numpy.save"]),
    "corrupt safetensors": (iv(vector={"file": "junk.safetensors", "key": "a"}), ["not a readable .safetensors"]),
    "nan in vector": (iv(vector="nan.npy"), ["interventions[0].vector", "2 NaN/inf"]),
    "overflow to inf": (iv(vector="big.npy"), ["interventions[0].vector", "NaN/inf", "float32"]),
    "2-d vector": (iv(vector="2d.npy"), ["interventions[0].vector", "(2, 5)", "must be 1-D"]),
    "int vector": (iv(vector="ints.npy"), ["interventions[0].vector", "int64", "save a float array"]),
    "empty vector": (iv(vector="empty.npy"), ["interventions[0].vector", "is empty"]),
    "zeros with normalize": (iv(vector="zeros.npy", normalize=True), ["all zeros", "normalize"]),
    "zeros with ablate": (iv(vector="zeros.npy", op="ablate"), ["all zeros", "op ablate"]),
    "zeros with clamp": (iv(vector="zeros.npy", op="clamp"), ["all zeros", "op clamp"]),
    "missing key": (iv(layer=7, vector={"file": "all.safetensors"}),
                    ["interventions[0].vector.key", "no tensor 'resid_post.7'",
                     "(it has: resid_post.-1, resid_post.3, resid_pre.3)"]),
    "missing key, many": (iv(vector={"file": "many.safetensors", "key": "x"}),
                          ["resid_post.0, resid_post.1, resid_post.2", "resid_post.7, ... (12 in all)"]),
    "negative layer no key": (iv(layer=-1, vector={"file": "all.safetensors"}),
                              ["interventions[0].vector.key", "layer -1", "give `key:`", "non-negative"]),
    "key on npy": (iv(vector={"file": "v.npy", "key": "a"}), ["interventions[0].vector.key", "only to .safetensors"]),
    "interventions with no value": (".yaml", "interventions:\n", ["interventions: has no value", "interventions: []"]),
    "alpha given twice": (".yaml", "interventions:\n  - layer: 0\n    vector: v.npy\n    alpha: 2.0\n    alpha: 50.0\n",
                          ["key 'alpha' is given twice (lines 4 and 5): keep one"]),
    "interventions given twice": (".yaml", "interventions:\n  - {layer: 0, vector: v.npy}\ninterventions: []\n",
                                  ["key 'interventions' is given twice (lines 1 and 3)"]),
    "key given twice in json": (".json", '{"interventions": [\n  {"layer": 0, "vector": "v.npy",\n   "layer": 1}]}',
                                ["key 'layer' is given twice (lines 2 and 3)"]),
    "alpha inf as float32": (iv(alpha=1.0e39), ["interventions[0].alpha", "1e+39, which is inf in float32"]),
    "alpha*v inf as float32": (iv(alpha=1.0e38), ["interventions[0].alpha", "alpha*vector reaches 4e+38", "float32"]),
    "second intervention": ({"interventions": [{"layer": 0, "vector": "v.npy"},
                                               {"layer": 1, "vector": "v.npy", "alpha": "x"}]},
                            ["interventions[1].alpha"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(ERROR_CASES), ids=list(ERROR_CASES))
def test_every_problem_is_one_line_naming_file_field_and_fix(tree, case):
    vecs = tree / "vecs"
    prepare_bad_files(vecs)
    *source, fragments = ERROR_CASES[case]
    if len(source) == 1:
        where = "steering spec (dict)"
        with pytest.raises(SteeringError) as e:
            load_steering(source[0], base_dir=vecs)
    else:
        suffix, text = source
        path = write(vecs, "spec" + suffix, text)
        where = str(path)
        with pytest.raises(SteeringError) as e:
            load_steering(path)
    message = str(e.value)
    assert isinstance(e.value, ValueError)
    assert "\n" not in message and message.startswith(where + ": "), message
    assert "pydantic" not in message and "errors.pydantic.dev" not in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_missing_and_unreadable_spec_files(tmp_path):
    with pytest.raises(SteeringError, match=r"nope\.yaml: no such file") as e:
        load_steering(tmp_path / "nope.yaml")
    assert "\n" not in str(e.value)
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(SteeringError, match=r"dir\.yaml: cannot read the file") as e:
        load_steering(tmp_path / "dir.yaml")
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(SteeringError, match=r"bin\.yaml: cannot read the file"):
        load_steering(tmp_path / "bin.yaml")


def test_the_spec_allows_exactly_what_workers_accept():
    from typing import get_args

    from driver.steering.spec import InterventionSpec

    fields = InterventionSpec.model_fields
    assert (get_args(fields["site"].annotation), get_args(fields["op"].annotation)) == (SITES, OPS)
    assert get_args(fields["positions"].annotation) == POSITIONS


# --- the steering page's own example (docs/steering.md), as a user runs it -------------------------------------------


def _driver(*args, cwd: Path):
    """`driver ARGS` in this process (testbed.inproc); `--address session` is the session's cluster (`ray_cluster`)."""
    from testbed.inproc import driver, session_address

    return driver(*(session_address() if a == "session" else a for a in args), cwd=cwd)


def steering_page_spec() -> str:
    """The first YAML block of the steering page (docs/steering.md, which README links), as printed there."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "steering.md").read_text()
    start = page.index("```yaml\n") + 8
    return page[start : page.index("```", start)]


@pytest.mark.usefixtures("ray_cluster")
def test_the_steering_pages_example_runs_as_printed(stories_path, tasks_dir, tmp_path):
    """`layer: -1` with `vector: {file: vectors.safetensors}` reads the key `resid_post.<the last layer>` (4 on the
    5-layer TinyStories model), as docs/steering.md says; the file holds only that key, so no other reading can pass."""
    spec = steering_page_spec()
    assert "layer: -1" in spec and "vector: {file: vectors.safetensors}" in spec
    (tmp_path / "steer.yaml").write_text(spec)
    rng = np.random.default_rng(0)
    np.save(tmp_path / "happy.npy", rng.standard_normal(64).astype(np.float32))
    save_file({"resid_post.4": rng.standard_normal(64).astype(np.float32)}, str(tmp_path / "vectors.safetensors"))
    proc = _driver("run", "--model", stories_path, "--tasks", "orchard_mc", "--include-path", tasks_dir, "--limit", "4",
                   "--workers", "1", "--address", "session", "--steer", "steer.yaml", "--output-path", "out", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-3000:]
    (results,) = (tmp_path / "out").rglob("results_*.json")
    record = json.loads(results.read_text())["config"]["orchard"]["steering"]
    assert record["resolved_layers"] == [3, 4]
    assert [v["key"] for v in record["vectors"]] == [None, "resid_post.4"]


def test_worker_notes_are_printed_once_per_intervention(capsys):
    from driver.steering import spec as steer
    from worker.jobs import Results

    steer._WARNED.clear()
    note = "interventions[0] (add at resid_post layer 3): ‖α·v‖ is 1e+30× the residual norm there; the model no longer reads its input"
    for ratio in ("1e+30", "9.9e+29"):  # another chunk, another measurement: the same intervention
        steer.warn_once(Results([(0.0, False)], [note.replace("1e+30", ratio)]))
    steer.warn_once([(0.0, False)])  # a plain list (a grid's results): nothing to say
    assert capsys.readouterr().err.strip().splitlines() == [f"warning: {note}"]
    steer._WARNED.clear()


# --- attn_head: `head: h`, head_dim vectors, keys of interventions without a head unchanged ---------------------------


def test_keys_without_a_head_are_those_from_before_heads_existed():
    """The result cache stays valid: this digest was computed by worker/spec.py before `head` existed (commit e0e7f41)."""
    s = Steering(interventions=(
        Intervention(layer=3, site="attn_out", op="clamp", vector=(1.0, -2.0, 0.5), alpha=2.0, positions="last"),
        Intervention(layer=-1, vector=(0.25,) * 4),
    ))  # fmt: skip
    assert s.key() == "7482d33c4675e65cdef2025d06fc570268be7cfc493768ab6a3bfc4ab10529f3"
    one, other = (Steering(interventions=(Intervention(layer=0, site="attn_head", head=h, vector=(1.0, 2.0)),)) for h in (0, 1))
    assert one.key() != other.key()  # the head is part of the key when set


def test_head_goes_with_attn_head_only_and_is_checked_against_the_models_heads():
    with pytest.raises(ValueError, match="site attn_head needs `head: h`"):
        Intervention(layer=0, site="attn_head", vector=(1.0,))
    with pytest.raises(ValueError, match="`head` applies only to site attn_head, not resid_post"):
        Intervention(layer=0, head=1, vector=(1.0,))
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        Intervention(layer=0, site="attn_head", head=-1, vector=(1.0,))
    s = Steering(interventions=(Intervention(layer=1, site="attn_head", head=3, vector=(1.0, 2.0)),))
    assert check(s, 4, 8, (4, 2)) == s  # 4 heads of head_dim 2 in a hidden size of 8
    with pytest.raises(SteeringError, match=r"^interventions\[0\]\.head: 3 is out of range for a model with 3 attention heads \(use 0\.\.2\)$"):
        check(s, 4, 6, (3, 2))
    with pytest.raises(SteeringError, match=r"^interventions\[0\]\.vector: has 2 values but attn_head takes head_dim = 4 values"):
        check(s, 4, 16, (4, 4))


def test_attn_heads_default_key_names_layer_and_head(tree):
    vecs = tree / "vecs"
    save_file({"attn_head.1.3": np.ones(4, np.float32), "attn_head.3.2": np.full(4, 2.0, np.float32)}, str(vecs / "h.safetensors"))
    config = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 16, "num_attention_heads": 4}
    ref = {"file": "h.safetensors"}
    spec = {"interventions": [{"layer": 1, "site": "attn_head", "head": 3, "vector": ref},
                              {"layer": -1, "site": "attn_head", "head": 2, "vector": ref}]}  # fmt: skip
    got = for_model(spec, config, base_dir=vecs).steering.interventions
    assert [(i.layer, i.head, i.vector[0]) for i in got] == [(1, 3, 1.0), (3, 2, 2.0)]
    with pytest.raises(SteeringError, match=r"interventions\[0\]\.head: `head` applies only to site attn_head, not attn_out"):
        for_model(iv(site="attn_out", head=3), config, base_dir=vecs)
    with pytest.raises(SteeringError, match=r"interventions\[0\]\.head: site attn_head needs `head: h`"):
        for_model(iv(site="attn_head"), config, base_dir=vecs)
    with pytest.raises(SteeringError, match="has 5 values but attn_head takes head_dim = 4 values"):
        for_model(iv(site="attn_head", head=0), config, base_dir=vecs)


def test_head_shape_reads_hf_configs():
    from worker.spec import head_shape

    assert head_shape({"hidden_size": 64, "num_attention_heads": 4}) == (4, 16)
    assert head_shape({"hidden_size": 64, "num_attention_heads": 4, "head_dim": 32}) == (4, 32)  # qwen3, gemma
    assert head_shape({"n_embd": 48, "n_head": 3}) == (3, 16)  # gpt2
    assert head_shape({"text_config": {"hidden_size": 8, "num_attention_heads": 2}}) == (2, 4)
    assert head_shape({"hidden_size": 8}) == (None, None)
