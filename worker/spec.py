"""What crosses from the driver to a worker: plain frozen data, no behaviour, no imports of the worker's code.

`ModelSpec` decides which weights a worker holds, `Batching` how it cuts requests into forwards (never a
number), `Steering` which interventions are active around one job (a number-changing input, so it travels with
each call and is part of every result's cache key).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SITES = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "attn_head")
HEAD_SITES = ("attn_head",)  # sites of one attention head (`head: h`): vectors of length head_dim, not hidden size
# Families whose blocks run attention and MLP on the same input (x + attn(n(x)) + mlp(n(x))): no resid_mid.
# gpt_neox and stablelm say so per model, in `use_parallel_residual` (gpt_neox's default: true).
PARALLEL_FAMILIES = ("phi", "phixtral", "cohere", "cohere2")


def parallel_block(family: str, use_parallel_residual: object) -> bool:
    return family in PARALLEL_FAMILIES or use_parallel_residual is True


# Families whose blocks no hook can reach as one place, or whose residual stream is not [batch, seq, hidden]:
# {family: (sites refused at every layer, why)}. The worker's hooks apply the same table (worker.hooks).
RESIDUAL_SITES = ("resid_pre", "resid_mid", "resid_post")
FAMILY_GAPS = {
    "deepseek_v41": (RESIDUAL_SITES, "its residual stream is several hyper-connection copies wide ([batch, seq, copies, "
                                     "hidden]), not one stream: steer attn_out or mlp_out"),
    "gemma3n": (RESIDUAL_SITES, "its residual stream is several AltUp copies wide ([copies, batch, seq, hidden]), not "
                                "one stream: steer attn_out or mlp_out"),
    "iquestloopcoder": (SITES, "its forward runs each block's parts itself, twice (two loops over the layers), so no "
                               "hook point is one place in it"),
}  # fmt: skip


def family_gaps(family: str) -> dict[str, str]:
    """{site: why} for the sites `family`'s blocks lack at every layer, whatever its config says."""
    sites, why = FAMILY_GAPS.get(family, ((), ""))
    return {site: f"the {family} block has no {site}: {why}" for site in sites}


def site_missing(missing: Mapping[str, str], site: str, layer: int, n_layers: int | None = None) -> str | None:
    """Why `site` at `layer` is missing (a per-layer entry "site.L", else one for every layer "site"); None if not.
    A negative layer counts from the end when `n_layers` is known."""
    if n_layers and layer < 0:
        layer += n_layers
    return missing.get(f"{site}.{layer}") or missing.get(site)


def missing_sites(config: dict) -> dict[str, str]:
    """{site: why} for the sites a model's blocks lack, read off its config.json alone (the rules; the driver's
    check builds the model's blocks without weights and asks the hooks, `worker.hooks.skeleton`, falling back to these)."""
    family = str(config.get("model_type", "model"))
    missing = family_gaps(family)
    if not head_shape(config)[0]:
        missing["attn_head"] = f"the {family} config.json names no number of attention heads, so single heads cannot be told apart"
    if parallel_block(family, config.get("use_parallel_residual", family == "gpt_neox")):
        missing["resid_mid"] = parallel_gap(family)
    return missing


def parallel_gap(family: str) -> str:
    return (f"the {family} block runs attention and MLP in parallel on the same input, so it has no resid_mid: steer "
            "attn_out or mlp_out")  # fmt: skip


def head_shape(config: dict) -> tuple[int | None, int | None]:
    """(attention heads, head_dim) from an HF config.json dict (top level, then `text_config`); None if absent.
    head_dim is the config's own when it names one (qwen3, gemma), else hidden size / heads."""
    for source in (config, config.get("text_config") or {}):
        heads = next((source[k] for k in ("num_attention_heads", "n_head", "n_heads") if isinstance(source.get(k), int)), None)
        if heads:
            width = next((source[k] for k in ("hidden_size", "n_embd", "d_model") if isinstance(source.get(k), int)), None)
            dim = source.get("head_dim") if isinstance(source.get("head_dim"), int) else (width // heads if width else None)
            return heads, dim
    return None, None


class SteeringError(ValueError):
    """Steering that cannot apply (to this model); one line naming the intervention, the field and the fix."""

OPS = ("add", "replace", "ablate", "clamp")

FLOAT_MAX = {"float32": float(np.finfo(np.float32).max), "float16": float(np.finfo(np.float16).max),
             "bfloat16": 3.3895313892515355e38}  # fmt: skip
_DIRECTION_OPS = ("ablate", "clamp")  # they use u = v/|v|


def unit(vector: np.ndarray) -> np.ndarray:
    """v/|v| as float32, scaled by its largest entry first (in float64): entries of 1e30 are finite in float32
    while their sum of squares is not, so a plain norm would give inf and a zero "direction"."""
    v = np.asarray(vector, dtype=np.float64)
    biggest = float(np.abs(v).max(initial=0.0))
    if biggest == 0.0:
        return v.astype(np.float32)
    v = v / biggest
    return (v / np.linalg.norm(v)).astype(np.float32)


def overflow(name: str, values: np.ndarray, dtype: str = "float32") -> str | None:
    """Why `values` (float64) are not finite numbers in `dtype`, the precision steering runs in; None if they are."""
    finite = np.isfinite(values)
    if not finite.all():
        return f"{name} holds {int((~finite).sum())} NaN/inf value(s)"
    # a value rounds to inf in `dtype` only from half an ulp above its largest finite number; this bound is safe
    biggest = float(np.abs(values).max(initial=0.0))
    if biggest > FLOAT_MAX[dtype]:
        return f"{name} reaches {biggest:.3g}, which is inf in {dtype} (largest finite: {FLOAT_MAX[dtype]:.3g})"
    return None


def steering_overflow(alpha: float, vector: np.ndarray, op: str, normalize: bool, dtype: str = "float32") -> tuple[str, str] | None:
    """(field, why) when what an op computes from alpha and the vector is not finite in `dtype`, else None:
    alpha*v (alpha*u for normalize and clamp; ablate writes nothing). u = v/|v| is found in float64, scaled
    first (`unit`), so a vector whose norm is past `dtype`'s range still has its direction."""
    along = normalize or op in _DIRECTION_OPS
    if op == "ablate":
        return None
    scale = abs(alpha) * (1.0 if along else float(np.abs(vector).max(initial=0.0)))
    if scale > FLOAT_MAX[dtype]:
        return "alpha", (f"alpha*vector reaches {scale:.3g}, which is inf in {dtype} (largest finite: "
                         f"{FLOAT_MAX[dtype]:.3g}): use a smaller alpha")  # fmt: skip
    return None


POSITIONS = ("all", "prompt", "continuation", "last")
# One rule for heads in specs, sweeps and `driver vectors --heads`: 0-based, never counted from the end (a
# head's number is in its vectors' keys, attn_head.L.h, which must name the same head for every model).
NEGATIVE_HEAD = "heads are numbered from 0 and a negative head does not count from the end (layers do, heads do not)"


def head_problem(site: str, head: int | None) -> str | None:
    """Why `head` does not go with `site` (attn_head needs one, every other site has none); None when it does."""
    if site in HEAD_SITES and head is None:
        return f"site {site} needs `head: h` (which attention head, 0-based)"
    if site not in HEAD_SITES and head is not None:
        return f"`head` applies only to site {' / '.join(HEAD_SITES)}, not {site}: remove it or use site: attn_head"
    return None


def width_problem(site: str, length: int, hidden: int | None, head_dim: int | None) -> str | None:
    """Why a vector of `length` values does not fit `site` of a model (None: it fits, or the width is unknown)."""
    if site in HEAD_SITES:
        if head_dim is not None and length != head_dim:
            return f"has {length} values but {site} takes head_dim = {head_dim} values (one head's output, before the output projection)"
        return None
    if hidden is not None and length != hidden:
        return (f"has {length} values but the model's hidden size is {hidden} (use a vector made for this model, "
                "e.g. by `driver vectors`)")  # fmt: skip
    return None


class ModelSpec(BaseModel):
    """Everything that decides which weights a worker holds (and so belongs in the result-cache key)."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    model: str = Field(description="local model folder or Hugging Face repo id")
    adapter_path: str | None = None
    revision: str | None = None
    dtype: str | None = None
    max_length: int | None = Field(default=None, gt=1)
    trust_remote_code: bool = False


class Grouping(BaseModel):
    """How many nodes hold one copy of the model and how it is split across them (worker groups). Never a number:
    a split model's numbers equal the unsplit model's, so it is not part of the result-cache key."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    size: int = Field(default=1, ge=1, description="nodes (ranks) per copy of the model")
    split: Literal["pipeline", "tensor"] = Field(
        default="pipeline", description="pipeline: contiguous layer ranges per rank; tensor: mlx-lm's shard(group)"
    )


class Batching(BaseModel):
    """How a worker cuts its requests into forward passes; never changes a number, only speed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    batch_size: int = Field(default=32, ge=1, description="most rows in one forward")
    max_batch_tokens: int = Field(default=8192, ge=1, description="most padded tokens in one forward")
    prefix_reuse: bool = Field(default=True, description="compute a prefix shared by many requests once")
    prefix_cache_mb: int = Field(default=1024, ge=0, description="MiB of prefix KV kept across chunks (0: none)")


class Condition(BaseModel):
    """CAST's condition (Lee et al. 2024, "Programming Refusal with Conditional Activation Steering"; IBM's
    activation-steering, leash_layer.py `_process_single_condition`): at the input of each of `layers` (resid_pre,
    as the LeashLayer wraps a decoder layer), on the prompt, h = the prompt's hidden states pooled (`mean` over its
    positions, or its `last`); sim = cos(h, tanh(P h)), P = c c^T / c^T c the projector on the condition vector c
    (malleable_model.py: torch.ger(c, c) / c.c); `greater` fires when sim > threshold, `smaller` when sim <
    threshold (the library's condition_comparator_threshold_is="smaller" / "larger": it names the threshold's
    side); it fires when it does at any of its layers (the library keeps the first layer's yes)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    vector: tuple[float, ...] = Field(repr=False)
    layers: tuple[int, ...] = Field(min_length=1)
    threshold: float = Field(allow_inf_nan=False)
    compare: Literal["greater", "smaller"] = "greater"
    pool: Literal["mean", "last"] = "mean"

    @field_validator("vector")
    @classmethod
    def _finite(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        problem = overflow("the condition vector", np.asarray(v, dtype=np.float64)) if v else "the condition vector is empty"
        if problem or not any(v):
            raise ValueError(problem or "the condition vector is all zeros: it names no direction")
        return v


class Gate(BaseModel):
    """When an intervention steers a row: `any` or `all` of its conditions fire on that row's prompt."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    conditions: tuple[Condition, ...] = Field(min_length=1)
    rule: Literal["any", "all"] = "any"

    def digest(self) -> dict:  # for the cache key: vectors by their float32 bytes
        sha = lambda v: hashlib.sha256(np.asarray(v, dtype=np.float32).tobytes()).hexdigest()  # noqa: E731
        return {"rule": self.rule, "conditions": [{**c.model_dump(exclude={"vector"}), "vector": sha(c.vector)} for c in self.conditions]}


class Intervention(BaseModel):
    """One edit of the residual stream at `site.layer`, at the selected positions of every row.

    add: x + alpha*v · replace: x + alpha*(v - x) (alpha 1 replaces) · ablate: x - (x.u)u ·
    clamp: x + (alpha - x.u)u, where u = v/|v|. `normalize` scales v to unit norm before any op.
    `layer` may count from the end (-1: the last block); the worker resolves it against its model.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    layer: int
    site: Literal["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "attn_head"] = "resid_post"
    op: Literal["add", "replace", "ablate", "clamp"] = "add"
    vector: tuple[float, ...] = Field(repr=False)
    head: int | None = Field(default=None, ge=0, description="attn_head only: which head's output (before o_proj)")
    alpha: float = 1.0
    positions: Literal["all", "prompt", "continuation", "last"] = "all"
    normalize: bool = False
    condition: Gate | None = None  # steer only the rows whose prompt passes it (CAST)

    @field_validator("vector")
    @classmethod
    def _finite(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if not v:
            raise ValueError("the vector is empty")
        problem = overflow("the vector", np.asarray(v, dtype=np.float64))
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("alpha")
    @classmethod
    def _finite_alpha(cls, a: float) -> float:
        problem = overflow("alpha", np.float64(a))
        if problem:
            raise ValueError(problem)
        return a

    @model_validator(mode="after")
    def _head_with_its_site(self) -> "Intervention":
        problem = head_problem(self.site, self.head)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _finite_product(self) -> "Intervention":
        problem = steering_overflow(self.alpha, np.asarray(self.vector, dtype=np.float64), self.op, self.normalize)
        if problem:
            raise ValueError(problem[1])
        return self

    def array(self) -> np.ndarray:
        """The vector as float32, unit norm when `normalize` is set."""
        v = np.asarray(self.vector, dtype=np.float32)
        if self.normalize:
            if not v.any():
                raise ValueError(f"cannot normalize the all-zero vector of layer {self.layer}")
            v = unit(v)
        return v

    def vector_sha256(self) -> str:
        return hashlib.sha256(np.asarray(self.vector, dtype=np.float32).tobytes()).hexdigest()


class Steering(BaseModel):
    """The interventions active around one job, applied in order; empty means the plain model."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    interventions: tuple[Intervention, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.interventions)

    def resolve(self, n_layers: int | None, hidden: int | None, heads: tuple[int | None, int | None] = (None, None)) -> "Steering":
        """Checked against a model's shape (None skips that check; `heads`: its (attention heads, head_dim)),
        negative layers made non-negative."""
        out = []
        for i, iv in enumerate(self.interventions):
            layer = iv.layer
            if n_layers is not None:
                layer = iv.layer + n_layers if iv.layer < 0 else iv.layer
                if not 0 <= layer < n_layers:
                    raise SteeringError(
                        f"interventions[{i}].layer: {iv.layer} is out of range for a model with {n_layers} layers "
                        f"(use 0..{n_layers - 1}, or -{n_layers}..-1 from the end)"
                    )
            if iv.head is not None and heads[0] is not None and iv.head >= heads[0]:
                raise SteeringError(f"interventions[{i}].head: {iv.head} is out of range for a model with {heads[0]} attention heads (use 0..{heads[0] - 1})")
            problem = width_problem(iv.site, len(iv.vector), hidden, heads[1])
            if problem:
                raise SteeringError(f"interventions[{i}].vector: {problem}")
            update = {"layer": layer} if layer != iv.layer else {}
            if iv.condition is not None:
                update["condition"] = resolve_gate(iv.condition, layer, n_layers, hidden, f"interventions[{i}].condition")
            out.append(iv.model_copy(update=update) if update else iv)
        return Steering(interventions=tuple(out))

    @property
    def conditional(self) -> bool:
        return any(iv.condition is not None for iv in self.interventions)

    def key(self) -> str:
        """A digest of everything that changes a number (vectors by their float32 bytes); '' when empty."""
        if not self.interventions:
            return ""
        # `head` only when set: the keys of interventions without one stay those of before heads existed
        rows = [{**i.model_dump(exclude={"vector", "condition"} | ({"head"} if i.head is None else set())), "vector": i.vector_sha256()}
                | ({"condition": i.condition.digest()} if i.condition else {}) for i in self.interventions]  # fmt: skip
        return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()


def resolve_gate(gate: Gate, layer: int, n_layers: int | None, hidden: int | None, where: str) -> Gate:
    """`gate` checked against a model (condition vectors of its hidden size, layers in range, none after the
    steered `layer`: the decision must be known when that layer runs), its layers made non-negative."""
    conditions = []
    for k, c in enumerate(gate.conditions):
        name = f"{where}[{k}]" if len(gate.conditions) > 1 else where
        if hidden is not None and len(c.vector) != hidden:
            raise SteeringError(f"{name}.vector: has {len(c.vector)} values but the model's hidden size is {hidden}: "
                                "pass a condition vector made for this model")  # fmt: skip
        layers = tuple(L + n_layers if n_layers is not None and L < 0 else L for L in c.layers)
        for L, given in zip(layers, c.layers):
            if n_layers is not None and not 0 <= L < n_layers:
                raise SteeringError(f"{name}.layers: {given} is out of range for a model with {n_layers} layers (use 0..{n_layers - 1})")
            if n_layers is not None and L > layer:
                raise SteeringError(
                    f"{name}.layers: {given} comes after the steered layer {layer}: the prompt reaches the steered "
                    f"layer before the condition is known; use condition layers <= {layer}"
                )
        conditions.append(c.model_copy(update={"layers": layers}) if layers != c.layers else c)
    return gate.model_copy(update={"conditions": tuple(conditions)})


NO_STEERING = Steering()


class Job(BaseModel):
    """What one call asks of a worker besides its requests: the kernel, the steering around it, capture points.

    Everything here can change a number, so all of it is part of each result's cache key.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["loglikelihood", "generate", "capture", "patch"]  # patch: worker.patch.spec's requests
    steering: Steering = NO_STEERING
    points: tuple[str, ...] = ()  # capture only: hook points such as "resid_post.3"
    # A grid chunk: each request runs under each of these configurations (results per request per
    # configuration, worker.grid); `steering` stays empty. Each result's cache key is that of
    # Job(kind=kind, steering=configuration), never this job's.
    grid: tuple[Steering, ...] = ()

    @model_validator(mode="after")
    def _grid_alone(self) -> "Job":
        if self.grid and (self.kind in ("capture", "patch") or self.steering or self.points):
            raise ValueError("a grid job is loglikelihood or generate work with its steering in `grid` only")
        return self

    def key(self) -> str:
        base = [self.kind, self.steering.key(), list(self.points)]
        return json.dumps(base + [[s.key() for s in self.grid]] if self.grid else base)
