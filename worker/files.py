"""A model folder's files checked from their bytes, without loading a tensor: each safetensors header against
its file's size and the config's shapes (hidden size, layers, vocabulary), and the tokenizer's files parse.

Run by worker.load.validate_local, so `driver`'s pre-flight (before Ray) and every worker refuse the same
folder with the same one line."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
_EMBEDDING = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "tok_embeddings.weight")
_HEADER_LIMIT = 100 * 2**20  # safetensors' own cap on a header
_TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json")


class FileProblem(ValueError):
    """A model file that cannot be right; the message is one line naming the file and the fix."""


def safetensors_header(path: Path) -> dict:
    """The tensors a safetensors file declares ({name: {dtype, shape, data_offsets}}), checked against its size."""
    again = "the file is damaged or incomplete: download or convert the model again"
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= min(_HEADER_LIMIT, size - 8):
            raise FileProblem(f"{path} is not a safetensors file (no valid header in its {size} bytes): {again}")
        try:
            header = json.loads(fh.read(n))
        except (ValueError, UnicodeDecodeError):
            raise FileProblem(f"{path}: its safetensors header is not valid JSON: {again}") from None
    tensors = {k: v for k, v in header.items() if k != "__metadata__"} if isinstance(header, dict) else None
    try:
        end = 8 + n + max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError):
        raise FileProblem(f"{path}: its safetensors header does not describe tensors: {again}") from None
    if end > size:
        raise FileProblem(f"{path} is truncated: {size} bytes, but its header describes {end}: {again}")
    return tensors


LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
WIDTH_KEYS = ("hidden_size", "n_embd", "d_model", "dim")


def config_int(config: dict, keys: tuple[str, ...]) -> int | None:
    """The first positive integer under one of `keys`, in the config or its `text_config` (multimodal models)."""
    for source in (config, config.get("text_config") or {}):
        for key in keys:
            value = source.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def check_weights(folder: Path, config: dict) -> dict[str, str]:
    """Every model*.safetensors header read and checked; {tensor name: file name}. Shapes against config.json
    (not for quantized models, whose packed shapes differ)."""
    owner: dict[str, str] = {}
    embedding: tuple[str, list] | None = None
    layers = 0
    for path in sorted(folder.glob("model*.safetensors")):
        for name, info in safetensors_header(path).items():
            owner[name] = path.name
            found = _LAYER.search(name)
            layers = max(layers, int(found.group(1)) + 1 if found else 0)
            if embedding is None and name.endswith(_EMBEDDING) and len(info.get("shape", ())) == 2:
                embedding = (f"{name} in {path.name}", info["shape"])
    if "quantization" not in config and "quantization_config" not in config:
        _check_shapes(folder, config, embedding, layers)
    return owner


def _check_shapes(folder: Path, config: dict, embedding: tuple[str, list] | None, layers: int) -> None:
    fix = "the weights and config.json are from different models: copy the matching config.json"
    want_layers = config_int(config, LAYER_KEYS)
    if want_layers and layers and layers < want_layers:
        raise FileProblem(f"{folder}: config.json says {want_layers} layers but the weights hold {layers}: {fix}")
    if embedding is None:
        return
    where, (rows, width) = embedding
    hidden = config_int(config, WIDTH_KEYS)
    vocab = config_int(config, ("vocab_size",))
    if hidden and width != hidden:
        raise FileProblem(f"{folder}: config.json says hidden size {hidden} but {where} is {rows}x{width}: {fix}")
    if vocab and rows != vocab:
        raise FileProblem(f"{folder}: config.json says vocab_size {vocab} but {where} is {rows}x{width}: {fix}")


def check_tokenizer_files(folder: Path) -> None:
    """The tokenizer's JSON files parse, and tokenizer.json is one the `tokenizers` library can build."""
    for name in _TOKENIZER_JSON:
        path = folder / name
        if not path.is_file():
            continue
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise FileProblem(f"{path} is not valid JSON ({e.msg} at line {e.lineno}): copy the model's tokenizer files again") from None
        except UnicodeDecodeError:
            raise FileProblem(f"{path} is not valid JSON (not UTF-8 text): copy the model's tokenizer files again") from None
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # the library's own reason, first line
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise FileProblem(f"{folder / 'tokenizer.json'} is not a tokenizer the `tokenizers` library can load ({first}): copy the model's tokenizer files again") from None
