"""lm-eval models backed by MLX: `mlx` runs the worker kernels in this process.

`OrchardLM` owns everything lm-eval-specific (tokenization, the empty-context rule, rolling windows,
generation kwargs, chat templates); an executor owns the compute. `mlx-ray` (driver/lm/mlx_ray.py) is the
same class with an executor that shards requests over Ray actors, so both score identical token ids.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import has_bos_prefix
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from worker.generate import GenRequest
from worker.load import context_window
from worker.spec import Batching, Job, ModelSpec, Steering

from driver.lm import generation, model_setup
from driver.lm.finite import check_scores, finite_generation
from driver.lm.local import Executor, LocalExecutor
from driver.lm.stream import pieces, spot_checks
from driver.lm.tokenize import Plan, empty_context, iter_encode_pairs, make_plan
from driver.steering.conditions import FireCounts

TokenPair = tuple[tuple[int, ...], tuple[int, ...]]


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
        prefix_cache_mb: int | str = 1024,
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
        model_setup.check_args(batch_size, max_batch_tokens=max_batch_tokens, max_length=max_length, dtype=dtype,
                               prefix_reuse=prefix_reuse, prefix_cache_mb=prefix_cache_mb, max_gen_toks=max_gen_toks,
                               trust_remote_code=trust_remote_code)  # fmt: skip
        self.spec = model_setup.model_spec(pretrained, adapter_path, revision, dtype, max_length, trust_remote_code)
        self.batching = model_setup.batching(batch_size, max_batch_tokens, prefix_reuse, prefix_cache_mb)
        files = model_setup.read_model_files(self.spec)
        self.tokenizer, self.generation_defaults = files.tokenizer, files.generation_defaults
        self._max_length = context_window(files.config, self.spec.max_length)
        self.max_gen_toks = int(max_gen_toks)
        self.sampling_seed: int | None = None  # the run's seed for sampled generation (set by driver.lm.evaluation)
        self._token_plan: Plan | None = None  # what driver.lm.tokenize proved for this tokenizer (on first use)
        self.fire_counts = FireCounts()  # conditional steering: rows fired per task (driver.lm.evaluation reports them)
        self.steering, self.steering_record = model_setup.model_steering(steer, files.config, self.spec.dtype)
        self.identity = model_setup.model_identity(self.spec, files.folder, self._max_length)
        self.executor: Executor = self.make_executor(self.spec, self.batching)

    def _init_extra(self, kwargs: dict) -> None:
        """Subclasses take their own model_args here; anything left is a mistake worth a clear error."""
        if kwargs:
            raise ValueError(model_setup.unknown_model_args(type(self).__name__, kwargs, ray=hasattr(self, "ray_args")))

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

    @contextlib.contextmanager
    def steered(self, steering: Steering, record: dict | None = None) -> Iterator[OrchardLM]:
        """A context manager: inside it every request runs under `steering` (and `record` is what the results
        JSON reports), as if the model had been built with it; the model's own steering is back afterwards.
        A sweep evaluates each configuration on the one loaded model this way."""
        saved = self.steering, self.steering_record
        self.steering, self.steering_record = steering, record
        try:
            yield self
        finally:
            self.steering, self.steering_record = saved

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
        results = self.fire_counts.take("loglikelihood", requests, results, self.steering)
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
        results = self.fire_counts.take("loglikelihood", pairs, self.executor.run(self.job("loglikelihood"), pairs), self.steering)
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
        scores = self.fire_counts.take("loglikelihood", requests, self.executor.run(self.job("loglikelihood"), windows), self.steering, owners)
        for n, (logprob, _) in zip(owners, scores):
            totals[n] += logprob
        check_scores(requests, totals, self.steering)
        for r, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, total)
        return totals

    def generation_request(self, context: str, gen_kwargs: dict, occurrence: int = 0, run_seed: int | None = None) -> GenRequest:
        return generation.request(self, context, gen_kwargs, occurrence, run_seed)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        gen_requests = [self.generation_request(*r, self.sampling_seed) for r in generation.occurrences(requests)]
        with finite_generation(requests, self.steering):
            outputs = self.fire_counts.take("generate", requests, self.executor.run(self.job("generate"), gen_requests), self.steering)
        for r, text in zip(requests, outputs):
            self.cache_hook.add_partial("generate_until", r.args, text)
        return outputs

    def get_model_info(self) -> dict:
        info = {**self.identity, **self.batching.model_dump(), **self.executor.info()}
        return {"orchard": {**info, "steering": self.steering_record}}


@register_model("mlx")
class MLXLM(OrchardLM):
    """In-process MLX model: `simple_evaluate(model="mlx", model_args="pretrained=PATH,batch_size=8")`."""
