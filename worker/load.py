"""Load one MLX model the way mlx-lm does, instrumented and ready for the scoring kernels."""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .hooks import HookManager, instrument
from .identity import folder_identity
from .spec import ModelSpec
from .split.plan import LAYER_KEYS, config_int  # config reading, shared with the split's pre-flight check
from .staged import StageError
from .staged import resolve as staged_folder

if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.tokenizer_utils import TokenizerWrapper

DEFAULT_MAX_LENGTH = 2048
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length", "max_sequence_length")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_DTYPES = ("float32", "float16", "bfloat16")


# --- a model folder's files checked from their bytes, without loading a tensor: each safetensors header
# against its file's size and the config's shapes, and the tokenizer's files parse. validate_local runs them, so
# `driver`'s pre-flight (before Ray) and every worker refuse the same folder with the same one line.

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


WIDTH_KEYS = ("hidden_size", "n_embd", "d_model", "dim")


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


class ModelLoadError(ValueError):
    """A model that cannot be loaded; the message names the problem and the fix in one line."""


@dataclass
class Head:
    """Split of a model into body (tokens -> final hidden states) and head (hidden -> logits).

    Scoring needs logits only at the positions being scored; running the LM head on those rows alone
    saves a [tokens x vocab] matmul per forward. `split` is False when the model does more than
    `head(body(x))` (logit soft-capping, scaling...): then the full forward runs and rows are gathered.
    """

    body: Callable[..., "mx.array"]
    head: Callable[["mx.array"], "mx.array"]
    split: bool

    @classmethod
    def for_model(cls, model: "nn.Module") -> "Head":
        import mlx.core as mx

        full = cls(lambda x, cache=None: model(x, cache=cache), lambda h: h, False)
        inner = getattr(model, "model", None)
        if inner is None:
            return full
        if getattr(model, "lm_head", None) is not None and not getattr(getattr(model, "args", None), "tie_word_embeddings", False):
            head = model.lm_head
        else:
            emb = getattr(inner, "embed_tokens", None) or getattr(inner, "wte", None)
            if emb is None or not hasattr(emb, "as_linear"):
                return full
            head = emb.as_linear
        split = cls(lambda x, cache=None: inner(x, cache=cache), head, True)
        probe = mx.array([[1, 2, 3, 4]])
        try:
            same = mx.array_equal(split.head(split.body(probe)), model(probe)).item()
        except Exception:
            same = False
        return split if same else full


@dataclass
class LoadedModel:
    model: "nn.Module"  # decoder blocks wrapped by worker.hooks.instrument
    tokenizer: "TokenizerWrapper"  # the worker only decodes with it (generation stop strings)
    hooks: HookManager
    config: dict
    path: Path
    max_length: int
    head: Head = field(repr=False)  # hidden states -> logits at chosen rows
    group: Any = None  # the mx.distributed ring holding the model split (worker groups); None: the whole model here
    grouping: Any = None  # its worker.spec.Grouping (size, split); None unsplit
    layers: tuple[int, int] | None = None  # the global [start, end) of the blocks this process runs; all unsplit

    def __post_init__(self) -> None:
        if self.layers is None:
            self.layers = (0, self.hooks.n_layers)

    @property
    def n_layers(self) -> int:
        return self.hooks.n_layers


def is_local(path_or_repo: str) -> bool:
    """A Hugging Face repo id looks like `org/name` and is not an existing path; everything else is local."""
    p = Path(path_or_repo).expanduser()
    return p.exists() or not _REPO_ID.match(path_or_repo)


def validate_local(path: Path, adapter_path: str | None = None) -> None:
    """Check a local model folder (and adapter) before MLX is imported: one clear error per problem."""
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path} (pass a local model folder or a Hugging Face repo id)")
    if not path.is_dir():
        raise ModelLoadError(f"model path is not a folder: {path} (pass the folder holding config.json)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"no config.json in {path}: not a Hugging Face / mlx-lm model folder")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{config_file} is not valid JSON ({e.msg} at line {e.lineno})") from None
    except UnicodeDecodeError:
        raise ModelLoadError(f"{config_file} is not valid JSON (not UTF-8 text)") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{config_file} is not a JSON object")
    if not list(path.glob("model*.safetensors")):
        raise ModelLoadError(f"no model*.safetensors weights in {path} (convert with `mlx_lm.convert` first)")
    check_architecture(config, config_file)
    try:  # the bytes on disk: headers against sizes and config shapes, tokenizer files parse (above)
        check_weights(path, config)
        check_tokenizer_files(path)
    except FileProblem as e:
        raise ModelLoadError(str(e)) from None
    if adapter_path is not None:
        adapter = Path(adapter_path).expanduser()
        if not adapter.exists():
            raise ModelLoadError(f"adapter path does not exist: adapter_path={adapter_path} (pass the folder written by mlx_lm.lora)")
        if not (adapter / "adapter_config.json").is_file():
            raise ModelLoadError(f"no adapter_config.json in adapter_path={adapter_path}: not an mlx-lm LoRA adapter folder")


def check_architecture(config: dict, where: Any = "config.json") -> None:
    """mlx-lm builds this model_type. A plain file lookup first: importing mlx-lm (and MLX) is needed only for
    remapped names, so a pre-flight check stays fast."""
    import importlib.util

    model_type = config.get("model_type")
    if not model_type:
        raise ModelLoadError(f"{where} has no model_type: cannot tell which architecture to build")
    package = importlib.util.find_spec("mlx_lm")
    if isinstance(model_type, str) and re.fullmatch(r"\w+", model_type) and package and package.submodule_search_locations:
        if (Path(list(package.submodule_search_locations)[0]) / "models" / f"{model_type}.py").is_file():
            return
    from mlx_lm.utils import MODEL_REMAPPING

    module = MODEL_REMAPPING.get(model_type, model_type)
    if not re.fullmatch(r"\w+", module) or importlib.util.find_spec(f"mlx_lm.models.{module}") is None:
        raise ModelLoadError(
            f"unknown architecture {model_type!r} in {where}: mlx-lm has no such model (upgrade mlx-lm or use a supported model)"
        )


def model_shape(config: dict) -> tuple[int | None, int | None]:
    """(decoder layers, hidden size) from an HF config.json dict (top level, then `text_config`); None if absent."""
    return config_int(config, LAYER_KEYS), config_int(config, WIDTH_KEYS)


def context_window(config: dict, override: int | None = None) -> int:
    if override:
        return int(override)
    for source in (config, config.get("text_config") or {}):
        for key in _CONTEXT_KEYS:
            if isinstance(source.get(key), int) and source[key] > 0:
                return source[key]
    return DEFAULT_MAX_LENGTH


def resolve(path_or_repo: str, revision: str | None = None, adapter_path: str | None = None) -> Path:
    """A local folder (validated), this node's staged copy (`staged:<content id>`, worker.staged) or a Hugging
    Face snapshot (downloaded by mlx-lm's rules)."""
    try:
        staged = staged_folder(path_or_repo)
    except StageError as e:  # not staged here (or incomplete): one line, pinned on the node by the driver
        raise ModelLoadError(str(e)) from None
    if staged is not None:
        validate_local(staged, adapter_path)
        return staged
    if is_local(path_or_repo):
        path = Path(path_or_repo).expanduser().resolve()
        validate_local(path, adapter_path)
        return path
    from mlx_lm.utils import _download

    try:
        path = Path(_download(path_or_repo, revision=revision))
    except Exception as e:  # offline, unknown repo, gated repo...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"cannot fetch {path_or_repo!r} from the Hugging Face Hub: {first}") from None
    validate_local(path, adapter_path)
    return path


def weights_bytes(folder: Path) -> int:
    """Bytes of a model folder's weight files (what must fit in memory)."""
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))


def fingerprint(path: Path) -> str:
    """Identity of a model (or adapter) folder by content: every weight, adapter, tokenizer, config and chat
    template file's name, size and full sha256, each file's digest remembered on disk until its stat facts
    change (worker.identity). Any changed byte changes it, so the result cache never serves another model's
    numbers."""
    return folder_identity(Path(path))


def load(spec: ModelSpec | str, *, group: Any = None, grouping: Any = None, **settings: Any) -> LoadedModel:
    """Load model + tokenizer with mlx-lm, optionally cast, then wrap its decoder blocks with hooks.

    `load("path", max_length=64)` is short for `load(ModelSpec(model="path", max_length=64))`. With `group` (an
    mx.distributed ring of more than one rank) and `grouping` (worker.spec.Grouping) this rank loads only its
    share of the model (worker.split.share).
    """
    if isinstance(spec, str):
        spec = ModelSpec(model=spec, **settings)
    adapter_path, dtype = spec.adapter_path, spec.dtype
    if dtype is not None and dtype not in _DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}: choose one of {', '.join(_DTYPES)}")
    path = resolve(spec.model, spec.revision, adapter_path)
    if group is not None and group.size() > 1:
        return _load_share(spec, path, group, grouping)
    import mlx.core as mx

    model, tokenizer, config = mlx_load(path, spec)
    if dtype is not None and "quantization" not in config:
        model.set_dtype(getattr(mx, dtype))
    check_finite(model, path, dtype)
    model.eval()
    hooks = instrument(model)
    return LoadedModel(model, tokenizer, hooks, config, path, context_window(config, spec.max_length), Head.for_model(model))


def _load_share(spec: ModelSpec, path: Path, group: Any, grouping: Any) -> LoadedModel:
    """This rank's share of the model split over `group` as `grouping` says (worker.split.share)."""
    import mlx.core as mx

    from .split.share import SplitError, split_share

    model, tokenizer, config = mlx_load(path, spec, lazy=True)
    try:
        hooks, grouping, layers = split_share(model, config, spec.dtype, group, grouping)
    except SplitError as e:
        raise ModelLoadError(str(e)) from None
    check_finite(model, path, spec.dtype)
    model.eval()
    lm = LoadedModel(model, tokenizer, hooks, config, path, context_window(config, spec.max_length),
                     Head.for_model(model), group=group, grouping=grouping, layers=layers)  # fmt: skip
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))  # every rank holds its share before any job
    return lm


def mlx_load(path: Path, spec: ModelSpec, lazy: bool = False) -> tuple["nn.Module", "TokenizerWrapper", dict]:
    """mlx-lm's load of a resolved folder (and the spec's adapter); `lazy`: weights stay unread until evaluated."""
    from mlx_lm.utils import load as load_model_and_tokenizer

    adapter_path = spec.adapter_path
    try:
        return load_model_and_tokenizer(
            str(path),
            adapter_path=str(Path(adapter_path).expanduser()) if adapter_path else None,
            lazy=lazy,
            return_config=True,
            trust_remote_code=spec.trust_remote_code,
        )
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"mlx-lm could not load {path}: {first}") from None


def check_finite(model: "nn.Module", path: Path, dtype: str | None = None) -> None:
    """Every weight finite (one reduction per tensor): a NaN/inf weight is named with its file, never a result."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    named = tree_flatten(model.parameters())
    finite = [mx.all(mx.isfinite(w)) for _, w in named]
    for flag in finite:  # one tensor per eval: only its isfinite mask is ever in memory, not the whole model's
        mx.eval(flag)
    flags = mx.stack(finite) if finite else mx.array([True])
    if flags.all().item():
        return
    name = named[int(mx.argmin(flags.astype(mx.int32)).item())][0]
    file = check_weights(path, {}).get(name, "the model's weight files")
    fix = f" after the cast to {dtype}: load it without dtype={dtype}" if dtype else ": the file is damaged"
    raise ModelLoadError(f"{path}: weight {name} in {file} holds NaN or infinite values{fix}: download or convert the model again")
