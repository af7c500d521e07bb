"""Loading: local folders, dtypes, quantized weights, context windows, and one-line errors for bad input."""

from __future__ import annotations

import json
import shutil

import pytest

from worker.load import ModelLoadError, context_window, load
from worker.score import loglikelihood

REQS = [([1, 40, 50, 60], [70, 80]), ([1, 99], [5])]


def test_context_window_from_config_and_override(llama_path, gpt2_path):
    assert load(str(llama_path)).max_length == 512  # max_position_embeddings
    assert load(str(gpt2_path), max_length=64).max_length == 64
    assert context_window({"n_positions": 1024}) == 1024
    assert context_window({}) == 2048


# Measured |logprob - float32 logprob| on REQS: float16 9e-4 and 4e-4, bfloat16 0.041 and 0.022 (8 and 7 bits
# of mantissa). The bounds sit a few times either side: float32 weights (0.0) or the other half type fail.
@pytest.mark.parametrize("dtype,low,high", [("float16", 5e-5, 5e-3), ("bfloat16", 5e-3, 0.15)])
def test_half_precision_scores_close_to_float32(llama_path, dtype, low, high):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    plain = load(str(llama_path))
    assert {v.dtype for _, v in tree_flatten(plain.model.parameters())} == {mx.float32}
    half = load(str(llama_path), dtype=dtype)
    assert {v.dtype for _, v in tree_flatten(half.model.parameters())} == {getattr(mx, dtype)}
    ref, got = loglikelihood(plain, REQS), loglikelihood(half, REQS)
    diffs = [abs(a[0] - b[0]) for a, b in zip(got, ref)]
    assert all(low < d < high for d in diffs), diffs


def test_quantized_model_loads_and_scores(llama_path, tmp_path):
    from mlx_lm import convert

    out = tmp_path / "q4"
    convert(str(llama_path), str(out), quantize=True, q_group_size=32, q_bits=8)
    lm = load(str(out))
    assert "quantization" in lm.config
    ref = loglikelihood(load(str(llama_path)), REQS)
    got = loglikelihood(lm, REQS)
    assert all(abs(a[0] - b[0]) < 0.5 for a, b in zip(got, ref))


def one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


def test_missing_model_path(tmp_path):
    with pytest.raises(ModelLoadError) as e:
        load(str(tmp_path / "nowhere"))
    assert "model path does not exist" in one_line(e) and "nowhere" in one_line(e)


def test_missing_adapter_path(llama_path, tmp_path):
    with pytest.raises(ModelLoadError) as e:
        load(str(llama_path), adapter_path=str(tmp_path / "no-adapter"))
    assert "adapter path does not exist" in one_line(e)


def test_unknown_architecture(llama_path, tmp_path):
    broken = tmp_path / "weird"
    shutil.copytree(llama_path, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "model_type": "transmogrifier"}))
    with pytest.raises(ModelLoadError) as e:
        load(str(broken))
    assert "unknown architecture 'transmogrifier'" in one_line(e)


def test_folder_without_config_or_weights(llama_path, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load(str(empty))
    no_weights = tmp_path / "no-weights"
    shutil.copytree(llama_path, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ModelLoadError, match="no model.*safetensors"):
        load(str(no_weights))


def test_unknown_dtype(llama_path):
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        load(str(llama_path), dtype="float8")


def test_lora_adapter_changes_scores(llama_path, tmp_path):
    """An mlx-lm LoRA adapter folder loads on top of the weights; lora_b != 0 moves the numbers."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load as mlx_load

    model, _ = mlx_load(str(llama_path))
    lora = {"rank": 4, "scale": 10.0, "dropout": 0.0}
    linear_to_lora_layers(model, 2, lora)
    weights = {k: (v + 0.5 if k.endswith("lora_b") else v) for k, v in tree_flatten(model.parameters()) if "lora_" in k}
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    mx.save_safetensors(str(adapter / "adapters.safetensors"), weights)
    (adapter / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": lora}))
    base = loglikelihood(load(str(llama_path)), REQS)
    tuned = loglikelihood(load(str(llama_path), adapter_path=str(adapter)), REQS)
    assert all(abs(a[0] - b[0]) > 1e-3 for a, b in zip(tuned, base))


# --- the files' bytes, checked before anything loads (worker.load), and the weights' values at load -------------


def _copy(model, tmp_path):
    return shutil.copytree(model, tmp_path / "model")


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize(
    "damage, message",
    [
        ("truncate", "model.safetensors is truncated: "),
        ("garbage", "model.safetensors is not a safetensors file"),
        ("hidden", "config.json says hidden size 128 but model.embed_tokens.weight in model.safetensors is "),
        ("vocab", "config.json says vocab_size 7 but model.embed_tokens.weight in model.safetensors is "),
        ("layers", "config.json says 9 layers but the weights hold 2"),
        ("tokenizer-json", "tokenizer.json is not valid JSON (Expecting"),
        ("tokenizer", "tokenizer.json is not a tokenizer the `tokenizers` library can load"),
    ],
)
def test_damaged_files_are_one_line_before_loading(llama_path, tmp_path, damage, message):
    from worker.load import validate_local

    folder = _copy(llama_path, tmp_path)
    weights = folder / "model.safetensors"
    if damage == "truncate":
        with weights.open("r+b") as fh:
            fh.truncate(weights.stat().st_size - 1)
    elif damage == "garbage":
        weights.write_bytes(b"\xff" * 4096)
    elif damage in ("hidden", "vocab", "layers"):
        _edit_config(folder, **{"hidden": {"hidden_size": 128}, "vocab": {"vocab_size": 7}, "layers": {"num_hidden_layers": 9}}[damage])
    else:
        (folder / "tokenizer.json").write_text('{"version": "1.0",\n' if damage == "tokenizer-json" else '{"version": "1.0"}')
    with pytest.raises(ModelLoadError) as info:
        validate_local(folder)
    assert message in str(info.value) and "\n" not in str(info.value)
    validate_local(llama_path)  # the intact folder passes


def _overwrite(path, offset, data: bytes):
    with path.open("r+b") as fh:
        fh.seek(offset)
        fh.write(data)


def test_non_finite_weights_are_named_when_they_load(llama_path, tmp_path):
    from worker.load import safetensors_header

    folder = _copy(llama_path, tmp_path)
    weights = folder / "model.safetensors"
    header = safetensors_header(weights)
    name, info = max(header.items(), key=lambda kv: kv[1]["data_offsets"][1] - kv[1]["data_offsets"][0])
    start = 8 + int.from_bytes(weights.read_bytes()[:8], "little") + info["data_offsets"][0]
    _overwrite(weights, start, b"\xff" * 4096)  # 0xFFFFFFFF is a float32 NaN
    with pytest.raises(ModelLoadError) as info_:
        load(str(folder))
    assert str(info_.value) == (
        f"{folder}: weight {name} in model.safetensors holds NaN or infinite values: the file is damaged: "
        "download or convert the model again"
    )
