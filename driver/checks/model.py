"""The model a command names (local folder or Hub repo id), its config and tokenizer, a steering spec for it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from driver.checks.errors import BadUsage, Refused

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model", "spiece.model")
_HUB_SMALL_FILES = ["*.json", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _local(folder: Path, adapter_path: str | None) -> None:
    """The loader's own folder check (worker.load.validate_local), as a pre-flight refusal."""
    from worker.load import ModelLoadError, validate_local

    try:
        validate_local(folder, adapter_path or None)
    except ModelLoadError as e:
        raise Refused(str(e)) from None


def _hub(model: str, revision: str | None) -> Path:
    """The repo's snapshot folder: offline, the cached one (weights included); online, its small files."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    at = f"@{revision}" if revision else ""
    offline = _offline()
    try:
        return Path(snapshot_download(model, revision=revision, allow_patterns=_HUB_SMALL_FILES, local_files_only=offline))
    except LocalEntryNotFoundError:
        if offline:
            raise Refused(
                f"model {model}{at}: no such local folder, and not in the Hugging Face cache while HF_HUB_OFFLINE=1: "
                f"download it first (`hf download {model}`), or unset HF_HUB_OFFLINE"
            ) from None
        raise Refused(f"cannot reach the Hugging Face Hub to fetch {model}{at}: check the network, or download it first") from None
    except GatedRepoError:
        raise Refused(f"model {model} is gated on the Hugging Face Hub: accept its terms and log in (`hf auth login`)") from None
    except RepositoryNotFoundError:
        raise Refused(f"no model {model} on the Hugging Face Hub (or it is private: log in with `hf auth login`)") from None
    except RevisionNotFoundError:
        raise Refused(f"model {model} has no revision {revision!r} on the Hugging Face Hub") from None
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise Refused(f"cannot fetch {model}{at} from the Hugging Face Hub: {first}") from None


def check_model(model: str, revision: str | None = None, adapter_path: str | None = None) -> Path:
    """The folder holding the model's config and tokenizer (on this machine), every file check done."""
    from worker.load import is_local

    if is_local(model):
        folder = Path(model).expanduser().resolve()
        _local(folder, adapter_path)
        return folder
    folder = _hub(model, revision)
    if _offline():  # the workers will need the weights from the same cache
        if not list(folder.glob("model*.safetensors")):
            raise Refused(
                f"model {model}: the Hugging Face cache has its config and tokenizer but not its weights, and "
                f"HF_HUB_OFFLINE=1: download it (`hf download {model}`), or unset HF_HUB_OFFLINE"
            )
        _local(folder, adapter_path)
    elif adapter_path:
        _local_adapter_only(adapter_path)
    return folder


def _local_adapter_only(adapter_path: str) -> None:
    adapter = Path(adapter_path).expanduser()
    if not (adapter / "adapter_config.json").is_file():
        raise Refused(f"--model-args adapter_path={adapter_path}: no adapter_config.json there (not an mlx-lm LoRA adapter folder)")


def model_config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise Refused(f"cannot read {folder / 'config.json'}: {e}") from None


def check_tokenizer(folder: Path, apply_chat_template: bool = False) -> None:
    names = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
    if not any(n in names for n in _TOKENIZER_FILES) and not any(n.endswith(".tiktoken") for n in names):
        raise Refused(f"no tokenizer in {folder} (tokenizer.json, tokenizer.model or vocab files): copy the model's tokenizer files there")
    from worker.load import FileProblem, check_tokenizer_files

    try:  # for a Hub model's snapshot; a local folder's were checked with it (worker.load.validate_local)
        check_tokenizer_files(folder)
    except FileProblem as e:
        raise Refused(str(e)) from None
    if not apply_chat_template:
        return
    if "chat_template.jinja" in names or "chat_template.json" in names:
        return
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text()) if "tokenizer_config.json" in names else {}
    except (OSError, ValueError):
        config = {}
    if not config.get("chat_template"):
        raise Refused(
            f"--apply-chat-template: the tokenizer in {folder} has no chat template (none in tokenizer_config.json, "
            "no chat_template.jinja): drop the flag, or use a chat/instruct model"
        )


def check_vocabulary(folder: Path, tokenizer, config: dict) -> None:
    """Every id the tokenizer can give has a row in the model's embedding table. torch raises on an id past the
    table; MLX reads past it without an error (seen: random logits that changed run to run), so it is refused here."""
    from worker.split.plan import config_int

    rows, size = config_int(config, ("vocab_size",)), len(tokenizer)
    if rows and size > rows:
        raise Refused(f"{folder}: the tokenizer has {size} tokens but config.json's vocab_size is {rows}, so ids {rows} "
                      f"to {size - 1} have no embedding row: use the tokenizer that came with these weights")


def check_steering(steer: str, config: dict, dtype: str | None = None):
    """The spec's `worker.spec.Steering` for this model, every problem refused in one line; values checked in
    the dtype the model will compute in (`dtype`: model_args' dtype, else its config's)."""
    from driver.steering.spec import SteeringError, for_model

    try:
        return for_model(steer, config, dtype).steering
    except (SteeringError, ValueError, OSError) as e:
        raise Refused((str(e).strip().splitlines() or [type(e).__name__])[0]) from None


def check_heads_split(steering, grouping) -> None:
    """attn_head steering on a tensor-split group refused: each rank holds only some heads of every layer."""
    from worker.spec import HEAD_SITES

    heads = [iv for iv in (steering.interventions if steering else ()) if iv.site in HEAD_SITES]
    if heads and grouping.size > 1 and grouping.split == "tensor":
        raise BadUsage(f"{heads[0].site} steering on a tensor-split group: each node holds only some heads of every layer: use --split pipeline")


def check_site(config: dict, site: str, layers) -> None:
    """`site` at each of `layers` refused in one line where the model's blocks lack it, as the workers' hooks would
    (a hybrid's attention sites exist on its attention layers only): read off the blocks built without weights."""
    from worker.hooks.skeleton import missing_sites
    from worker.spec import site_missing

    missing = missing_sites(config)
    gap = next((why for layer in layers if (why := site_missing(missing, site, layer))), None)
    if gap:
        raise Refused(f"--site {site}: {gap}")


def check_generation_room(config: dict, max_length: int | None, model_args: dict, gen_kwargs: dict | None,
                          tasks: tuple[list[str], str | None] | None = None) -> None:  # fmt: skip
    """Every max-new-tokens setting given (model_args' max_gen_toks, --gen-kwargs' max_gen_toks or an alias) leaves
    room for a prompt in the model's context window: lm-eval keeps the prompt's last (window - max_gen_toks)
    tokens, so a limit at or past the window could never generate (found by the first request, after Ray).
    `tasks` (names, include path): their YAMLs' own max_gen_toks too (driver.checks.taskdata)."""
    from driver.checks.errors import BadUsage
    from driver.checks.settings import MAX_TOKENS
    from worker.load import context_window

    window = context_window(config, max_length)
    given = [(f"--gen-kwargs {k}", (gen_kwargs or {})[k]) for k in MAX_TOKENS if k in (gen_kwargs or {})]
    given += [("--model-args max_gen_toks", model_args["max_gen_toks"])] if model_args.get("max_gen_toks") is not None else []
    for where, value in given:
        if int(value) >= window:
            raise BadUsage(f"{where}={value}: must be less than the model's context window ({window} tokens), which "
                           f"must also hold the prompt: give a smaller limit{'' if max_length else ' or a larger --max-length'}")  # fmt: skip
    if tasks:
        from driver.checks.datasets import named_configs
        from driver.checks.taskdata import check_task_room

        check_task_room(named_configs(*tasks), window, model_args, gen_kwargs)
