"""lm-eval models backed by MLX: `mlx` runs the worker kernels in this process.

`OrchardLM` owns everything lm-eval-specific (tokenization, the empty-context rule, rolling windows,
generation kwargs, chat templates); an executor owns the compute. `mlx-ray` (driver/ray_lm.py) is the
same class with an executor that shards requests over Ray actors, so both score identical token ids.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from cluster.facts import blas, fast_blas
from worker.generate import GenRequest, truncate
from worker.grid import run_grid
from worker.jobs import run
from worker.load import context_window, fingerprint, is_local, load, resolve
from worker.spec import NO_STEERING, Batching, Job, ModelSpec, Steering

from driver.lm.finite import check_scores, finite_generation
from cluster.schedule import gather
from driver.lm.tokenize import Plan, empty_context, iter_encode_pairs, make_plan
from driver.steering.spec import for_model, warn_once

TokenPair = tuple[tuple[int, ...], tuple[int, ...]]
_TOKENIZER_FILES = ["*.json", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


class Executor(Protocol):
    def run(self, job: Job, requests: Iterable, total: int | None = None) -> list: ...
    def run_grid(self, kind: str, steerings: Sequence[Steering], requests: list) -> list[list]: ...
    def info(self) -> dict: ...
    def close(self) -> None: ...


FIRST_PIECE, LARGEST_PIECE = 256, 8192  # requests: the first piece small, to start workers within a second


SPOT_CHECKS = 4  # requests per piece re-tokenized by lm-eval's own path


def spot_checks(lo: int, hi: int) -> list[int]:
    """Which requests of piece [lo, hi) to compare with lm-eval's path: its first, last and evenly between."""
    return sorted({lo + (hi - 1 - lo) * k // (SPOT_CHECKS - 1) for k in range(SPOT_CHECKS)}) if hi > lo else []


def pieces(contexts: Sequence[str]) -> Iterator[tuple[int, int]]:
    """[lo, hi) bounds of growing pieces of a request list, each ending where the context changes (so the answer
    choices of one question, which share their input, stay in one piece)."""
    lo, size, n = 0, FIRST_PIECE, len(contexts)
    while lo < n:
        hi = min(lo + size, n)
        while hi < n and contexts[hi] == contexts[hi - 1]:
            hi += 1
        yield lo, hi
        lo, size = hi, min(2 * size, LARGEST_PIECE)


class LocalExecutor:
    """The worker kernels on a model loaded in this process."""

    def __init__(self, spec: ModelSpec, batching: Batching) -> None:
        self.lm = load(spec)
        self.batching = batching
        if blas().startswith("reference") and fast_blas():  # a fast BLAS must be preloaded before Python starts
            print(f"note: MLX runs on its reference BLAS here; start Python with LD_PRELOAD={fast_blas()} for ~10x", file=sys.stderr)

    def run(self, job: Job, requests: Iterable, total: int | None = None) -> list:
        results = run(self.lm, job, gather(requests, total), self.batching)
        warn_once(results)  # the steering's notes (e.g. it swamps the residual stream), once per run
        return results

    def run_grid(self, kind: str, steerings: Sequence[Steering], requests: list) -> list[list]:
        """Results [configuration][request], each equal to `run(Job(kind=kind, steering=s), requests)[i]`;
        blocks below the configurations' lowest steered layer run once per request (worker.grid)."""
        per_request = run_grid(self.lm, kind, list(steerings), requests, self.batching)
        return [[r[c] for r in per_request] for c in range(len(steerings))]

    def info(self) -> dict:
        return {"executor": "local", "head_split": self.lm.head.split}

    def close(self) -> None:
        self.lm = None


def _int_or_default(value: Any, default: int) -> int:
    if value is None or value == "auto" or str(value).startswith("auto"):
        return default
    return int(value)


def _bool(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


def tokenizer_folder(model: str, revision: str | None) -> Path:
    """Where the tokenizer lives: the model folder, or a tokenizer-only Hub snapshot (no weights)."""
    if is_local(model):
        return resolve(model)
    from mlx_lm.utils import _download

    return Path(_download(model, revision=revision, allow_patterns=_TOKENIZER_FILES))


def load_tokenizer(folder: Path, trust_remote_code: bool):
    """The model's HF tokenizer (the one lm-eval's hf backend uses)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    # Encoding a long few-shot prompt is not a mistake here (each request's window is cut, as lm-eval does):
    # mark transformers' "longer than the maximum" warning as already given.
    getattr(tokenizer, "deprecation_warnings", {})["sequence-length-is-longer-than-the-specified-maximum"] = True
    return tokenizer


def model_config(model: str, revision: str | None = None) -> dict:
    """The model's config.json, read without loading weights (a Hub model: its small files only)."""
    return json.loads((tokenizer_folder(model, revision) / "config.json").read_text())


def model_steering(steer: str | dict | Steering | None, config: dict) -> tuple[Steering, dict | None]:
    """The steering active for every request of a model, checked against its config before any worker starts,
    and what the results record of it (None without steering)."""
    if steer is None or steer == "":
        return NO_STEERING, None
    loaded = for_model(steer, config)
    steering = loaded.steering
    return steering, {**loaded.record, "key": steering.key(), "resolved_layers": [i.layer for i in steering.interventions]}


class OrchardLM(TemplateLM):
    """lm-eval glue shared by `mlx` and `mlx-ray`; subclasses choose the executor."""

    def __init__(
        self,
        pretrained: str,
        batch_size: int | str = 32,
        max_batch_tokens: int | str = 8192,
        max_length: int | str | None = None,
        adapter_path: str | None = None,
        dtype: str | None = None,
        revision: str | None = None,
        prefix_reuse: bool | str = True,
        max_gen_toks: int | str = 256,
        trust_remote_code: bool | str = False,
        steer: str | dict | Steering | None = None,
        **kwargs: Any,
    ) -> None:
        """`steer`: a steering spec (YAML/JSON file, dict or Steering) active for every request of this model."""
        super().__init__()
        for ignored in ("device", "max_batch_size"):  # lm-eval passes these to every backend
            kwargs.pop(ignored, None)
        self._init_extra(kwargs)
        from driver.checks.settings import check_model_args

        given = dict(max_batch_tokens=max_batch_tokens, max_length=max_length, dtype=dtype, prefix_reuse=prefix_reuse,
                     max_gen_toks=max_gen_toks, trust_remote_code=trust_remote_code)  # fmt: skip
        if not str(batch_size).startswith("auto"):  # lm-eval's "auto": the default
            given["batch_size"] = batch_size
        check_model_args({k: v for k, v in given.items() if v is not None})  # one line in the user's words
        self.spec = ModelSpec(
            model=str(pretrained),
            adapter_path=adapter_path,
            revision=revision,
            dtype=dtype,
            max_length=int(max_length) if max_length else None,
            trust_remote_code=_bool(trust_remote_code),
        )
        self.batching = Batching(
            batch_size=_int_or_default(batch_size, 32),
            max_batch_tokens=int(max_batch_tokens),
            prefix_reuse=_bool(prefix_reuse),
        )
        folder = tokenizer_folder(self.spec.model, revision)
        self.tokenizer = load_tokenizer(folder, self.spec.trust_remote_code)
        config = json.loads((folder / "config.json").read_text())
        gen_config = folder / "generation_config.json"
        self.generation_defaults = json.loads(gen_config.read_text()) if gen_config.exists() else {}
        self._max_length = context_window(config, self.spec.max_length)
        self.max_gen_toks = int(max_gen_toks)
        self._token_plan: Plan | None = None  # what driver.lm.tokenize proved for this tokenizer (on first use)
        self.steering, self.steering_record = model_steering(steer, config)
        self.identity = {
            "model": self.spec.model,
            "revision": self.spec.revision,
            "adapter": fingerprint(Path(adapter_path).expanduser()) if adapter_path else None,
            "files": fingerprint(folder),
            "dtype": self.spec.dtype,
            "max_length": self._max_length,
        }
        self.executor: Executor = self.make_executor(self.spec, self.batching)

    def _init_extra(self, kwargs: dict) -> None:
        """Subclasses take their own model_args here; anything left is a mistake worth a clear error."""
        if kwargs:
            from driver.checks.settings import MODEL_ARGS, RAY_ONLY, closest

            valid = [k for k in MODEL_ARGS if hasattr(self, "ray_args") or k not in RAY_ONLY]
            first = sorted(kwargs)[0]
            raise ValueError(f"unknown model_args for {type(self).__name__}: {', '.join(sorted(kwargs))}{closest(first, valid)}")

    def make_executor(self, spec: ModelSpec, batching: Batching) -> Executor:
        return LocalExecutor(spec, batching)

    # --- tokenization, exactly as lm-eval's hf backend -------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special = {"add_special_tokens": False}
        return self.tokenizer.encode(string, **special)

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    # --- requests --------------------------------------------------------------------------------

    def job(self, kind: str, **extra: Any) -> Job:
        """A job of this model's steering (every request lm-eval sends is steered the same way)."""
        return Job(kind=kind, steering=self.steering, **extra)

    def steered(self, steering: Steering, record: dict | None = None):
        """A context manager: inside it every request runs under `steering` (and `record` is what the results
        JSON reports), as if the model had been built with it; the model's own steering is back afterwards.
        A sweep evaluates each configuration on the one loaded model this way."""
        import contextlib

        @contextlib.contextmanager
        def block():
            saved = self.steering, self.steering_record
            self.steering, self.steering_record = steering, record
            try:
                yield self
            finally:
                self.steering, self.steering_record = saved

        return block()

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """TemplateLM.loglikelihood, streamed: requests are tokenized in pieces on a background thread (the Feed
        of cluster.schedule) and each piece goes to the workers as soon as it is ready."""
        pairs = [r.args for r in requests]
        bounds = list(pieces([context for context, _ in pairs]))
        bar = tqdm(total=len(pairs), desc="Tokenizing", unit="req", disable=disable_tqdm)

        def encoded() -> Iterator[list[TokenPair]]:
            for piece in self.encode_pieces(pairs, bounds):
                yield piece
                bar.update(len(piece))
            bar.close()

        results = self.executor.run(self.job("loglikelihood"), encoded(), total=len(pairs))
        check_scores(requests, results, self.steering)
        for args, answer in zip(pairs, results):
            self.cache_hook.add_partial("loglikelihood", args, answer)
        return results

    def encode_pieces(self, pairs: Sequence[tuple[str, str]], bounds: list[tuple[int, int]]) -> Iterator[list[TokenPair]]:
        """Token ids of (context, continuation) pairs exactly as TemplateLM.loglikelihood makes them (the
        empty-context rule, trailing spaces moved to the continuation), piece by piece ([lo, hi) `bounds`):
        driver.lm.tokenize's batch path, each piece spot-checked against lm-eval's own per-request path. A mismatch
        would be a wrong number: the rest of the run then takes lm-eval's path, with a warning."""
        if self._token_plan is None:
            self._token_plan = make_plan(self.tokenizer)
        plan = self._token_plan
        fast = iter_encode_pairs(self.tokenizer, pairs, self.prefix_token_id, bounds=bounds, plan=plan, parallel=True)
        for (lo, hi), piece in zip(bounds, fast):
            if plan.backend is not None and self._token_plan is plan:
                if any(piece[i - lo] != self._exact(*pairs[i]) for i in spot_checks(lo, hi)):
                    print("warning: fast tokenization differs from lm-eval's on a request: using lm-eval's path", file=sys.stderr)
                    self._token_plan = Plan(self.tokenizer, reason="a spot check failed")
            if self._token_plan is not plan:
                piece = [self._exact(*p) for p in pairs[lo:hi]]
            yield piece

    def _exact(self, context: str, continuation: str) -> TokenPair:
        """One request through lm-eval's own code (TemplateLM._encode_pair with this model's tok_encode)."""
        if context == "":
            return empty_context(self.tok_encode(continuation, add_special_tokens=False), self.prefix_token_id)
        ctx, cont = self._encode_pair(context, continuation)
        return tuple(ctx), tuple(cont)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        pairs = [(tuple(ctx), tuple(cont)) for _, ctx, cont in requests]
        results = self.executor.run(self.job("loglikelihood"), pairs)
        check_scores(pairs, results, self.steering)
        for (key, _, _), answer in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows: list[TokenPair] = []
        owners: list[int] = []
        for n, (string,) in enumerate(tqdm([r.args for r in requests], disable=disable_tqdm, desc="Rolling windows")):
            for ctx, cont in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((tuple(ctx), tuple(cont)))
                owners.append(n)
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(owners, self.executor.run(self.job("loglikelihood"), windows)):
            totals[n] += logprob
        check_scores(requests, totals, self.steering)
        for r, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, total)
        return totals

    def generation_request(self, context: str, gen_kwargs: dict, occurrence: int = 0) -> GenRequest:
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tok_decode([self.eot_token_id], False))
        temperature = float(kwargs.get("temperature", 0.0) or 0.0)
        # A per-request seed: the same request draws the same sample in any batch, on any worker;
        # repeats of one request (lm-eval's `repeats`) draw different ones.
        digest = hashlib.sha256(json.dumps([context, gen_kwargs, occurrence], sort_keys=True, default=str).encode())
        request = GenRequest(
            context=tuple(self.tok_encode(context)),
            until=tuple(until),
            max_gen_toks=int(kwargs.pop("max_gen_toks")),
            do_sample=bool(kwargs.get("do_sample", False)) and temperature > 0,
            temperature=temperature,
            # Unset sampling knobs fall back to the model's generation_config, as HF `generate` does.
            top_p=float(kwargs.get("top_p") or self.generation_defaults.get("top_p") or 1.0),
            top_k=int(kwargs.get("top_k") or self.generation_defaults.get("top_k", 50) or 0),
            seed=int.from_bytes(digest.digest()[:4], "little"),
        )
        return truncate(request, self.max_length)  # fails here, before any worker is busy

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        seen: Counter = Counter()
        gen_requests = []
        for r in requests:
            context, gen_kwargs = r.args
            key = json.dumps([context, gen_kwargs], sort_keys=True, default=str)
            gen_requests.append(self.generation_request(context, gen_kwargs, seen[key]))
            seen[key] += 1
        with finite_generation(requests, self.steering):
            outputs = self.executor.run(self.job("generate"), gen_requests)
        for r, text in zip(requests, outputs):
            self.cache_hook.add_partial("generate_until", r.args, text)
        return outputs

    def get_model_info(self) -> dict:
        info = {**self.identity, **self.batching.model_dump(), **self.executor.info()}
        return {"orchard": {**info, "steering": self.steering_record}}


@register_model("mlx")
class MLXLM(OrchardLM):
    """In-process MLX model: `simple_evaluate(model="mlx", model_args="pretrained=PATH,batch_size=8")`."""
