"""A sweep's configurations: each vector of the grid (a file, a file per layer, SAE features, an SAE's top K on a
prompt set) read and checked at each place (site, layer, head) as `driver run` checks a spec, then crossed with the
grid's ops, positions, alphas and, under the file's `condition:`, thresholds."""

from __future__ import annotations

import difflib
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from worker.spec import HEAD_SITES, NO_STEERING, Intervention, Steering

from driver.sweep.rows import BASELINE
from driver.sweep.schema import Grid, SweepError, SweepFile, VectorSource, one_line

__all__ = ["Config", "TopAt", "Model", "BASELINE", "FEATURE_ACTIVATION", "grid_configs", "nonempty", "grid_vectors", "choose_top",
           "measure_features"]


_DIRECTIONLESS = ("ablate", "clamp")  # ops that need a nonzero vector
_IDENTITY_AT_ZERO = ("add", "replace")  # ops for which alpha 0 is the unsteered model


@dataclass(frozen=True)
class Config:
    """One steering configuration of the grid (the baseline: every field None, no interventions)."""

    id: str
    steering: Steering
    vector: str | None = None
    site: str | None = None
    layer: int | None = None
    op: str | None = None
    positions: str | None = None
    alpha: float | None = None  # None: the baseline, or an op that takes no alpha (ablate)
    record: dict | None = None  # what goes into lm-eval's results JSON (config.orchard.steering)
    head: int | None = None  # the attention head, at a head site (attn_head)
    threshold: float | None = None  # the CAST condition's threshold (the file's `condition:`), or None: unconditional
    text: str | None = None  # a prompting baseline's text before every prompt (op "prompt", driver.judge.prompting)

    @property
    def fields(self) -> dict:
        return {"config": self.id, "vector": self.vector, "layer": self.layer, "site": self.site, "head": self.head,
                "op": self.op, "positions": self.positions, "alpha": 0.0 if self.id == BASELINE else self.alpha,
                "threshold": self.threshold}  # fmt: skip


@dataclass(frozen=True)
class TopAt:
    """An SAE source with `prompts:` at one place of the grid: its SAE's encoder (checked) and the prompts its features
    are ranked on (`top: K`: k) and measured on (`features:` too: k None)."""

    name: str
    site: str
    layer: int
    encoder: Any  # driver.steering.encoders.Encoder
    k: int | None
    file: str
    prompts: list  # [driver.sweep.plan.Prompt]


@dataclass(frozen=True)
class Model:
    """What the vectors are checked against: the model's config.json, its dtype setting, its layer count."""

    config: dict
    dtype: str | None
    n_layers: int
    hidden: int | None = None
    condition: dict | None = None  # the file's `condition:` as a spec writes it, at its first threshold (checked so)


def _vector_file(name: str, source: VectorSource, layer: int, n_layers: int, where: str) -> tuple[str, str]:
    """(file, label) of a vector source at one layer: its file, or its `layers:` entry for that layer."""
    label = f"vectors.{name}"
    if source.layers is None:
        return source.file, label
    file = source.layers.get(layer)
    if file is None:
        negative = {k % n_layers: f for k, f in source.layers.items() if -n_layers <= k < n_layers}
        file = negative.get(layer)
    if file is None:
        listed = ", ".join(map(str, sorted(source.layers)))
        raise SweepError(f"{where}: {label}.layers: no vector for layer {layer} (it has layers {listed}); add one or drop the layer from grid.layers")
    return file, f"{label}.layers.{layer}"


def _vector_ref(name: str, source: VectorSource, at: tuple, n_layers: int, where: str) -> tuple[str, dict]:
    """(label, the spec's `vector:`) of a vector source at `at` = (site, layer, head)."""
    site, layer, head = at
    if source.sae is not None:  # one feature: the plan's expansion leaves one per source
        return f"vectors.{name}", {"sae": source.sae, "feature": source.features[0]}
    file, label = _vector_file(name, source, layer, n_layers, where)
    ref: dict = {"file": file}
    if file.lower().endswith(".safetensors"):
        default = "{site}.{layer}.{head}" if head is not None else "{site}.{layer}"  # as `driver vectors` keys them
        ref["key"] = (source.key or default).format(site=site, layer=layer, head=head)
    elif source.key is not None and source.file is not None:
        raise SweepError(f"{where}: {label}.key: `key` applies only to .safetensors files; remove it")
    return label, ref


def _load_vector(name: str, source: VectorSource, at: tuple, ops: Sequence[str], model: Model, base: Path, where: str):
    """The checked `Intervention` (alpha 1, op add) for one vector at `at` = (site, layer, head), and its record;
    checked as `driver run` checks a spec (driver.steering.spec.for_model): shape, dtype, the sites the model has."""
    from driver.steering.spec import SteeringError, for_model

    site, layer, head = at
    label, ref = _vector_ref(name, source, at, model.n_layers, where)
    # checked as add writes it (in the model's dtype) when an op writes v itself, and for a direction (a zero
    # vector refused naming the op) when an op needs one: ablate, clamp
    directionless = next((op for op in ops if op in _DIRECTIONLESS), None)
    checked_as = "add" if directionless is None or any(op not in _DIRECTIONLESS for op in ops) else directionless
    iv = {"layer": layer, "site": site, "op": checked_as, "vector": ref, "normalize": source.normalize}
    iv |= ({} if head is None else {"head": head}) | ({} if model.condition is None else {"condition": model.condition})
    try:
        loaded = for_model({"interventions": [iv]}, model.config, model.dtype, base)
    except SteeringError as e:
        text = str(e).removeprefix("steering spec (dict): ")
        if text.startswith("interventions[0].condition"):  # the file's `condition:`, not the vector's
            label, text = "condition", text.removeprefix("interventions[0].condition")
        for prefix in ("interventions[0].vector", "interventions[0]"):
            if text.startswith(prefix):
                text = text[len(prefix) :]
                break
        text = re.sub(r"^\.(file|key)", lambda m: "" if source.layers is not None else m.group(0), text)
        text = text.replace("interventions[0].", "")
        at_head = "" if head is None else f", head {head}"
        raise SweepError(one_line(f"{where}: {label}{text} (layer {layer}, site {site}{at_head})")) from None
    first = loaded.steering.interventions[0]
    if directionless and not any(first.vector):
        at_head = "" if head is None else f", head {head}"
        raise SweepError(f"{where}: {label}: is all zeros, so it has no direction for op {directionless}: use a nonzero "
                         f"vector (layer {layer}, site {site}{at_head})")  # fmt: skip
    return first.model_copy(update={"op": "add"}), loaded.record["vectors"][0]


def _fmt_alpha(alpha: float) -> str:
    return f"{alpha:+g}"


def _steering(iv: Intervention, where: str) -> Steering:
    """One configuration's steering, validated as the worker will (e.g. alpha·v finite in float32)."""
    try:
        return Steering(interventions=(iv,))
    except ValidationError as e:
        raise SweepError(one_line(f"{where}: {e.errors()[0]['msg'].removeprefix('Value error, ')}")) from None


def grid_vectors(spec: SweepFile, where: str) -> list[str]:
    """The vector sources the grid steers with (grid.vectors, by default every one)."""
    g = spec.grid
    names = list(g.vectors) if g.vectors is not None else list(spec.vectors)
    unknown = [n for n in names if n not in spec.vectors]
    if unknown:
        near = difflib.get_close_matches(unknown[0], list(spec.vectors), n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise SweepError(f"{where}: grid.vectors: no vector named {unknown[0]!r} ({hint}the file has: {', '.join(spec.vectors)})")
    return names


def _vector_names(spec: SweepFile, where: str, chosen: dict) -> list[str]:
    """Every vector of the grid: a source's name, NAME-fN per feature N of an SAE source (`top`: those `chosen` at
    some place, {(name, site, layer): features}, none before they are)."""
    out = []
    for n in grid_vectors(spec, where):
        s = spec.vectors[n]
        features = s.features or [f for (name, *_), fs in chosen.items() if name == n for f in fs]
        out += [f"{n}-f{f}" for f in dict.fromkeys(features)] if s.sae is not None else [n]
    return out


def feature_of(spec: SweepFile, name: str) -> tuple[str, int] | None:
    """(NAME, N) for a vector named NAME-fN, feature N of the SAE source NAME (the features axis), else None."""
    base, sep, feature = name.rpartition("-f")
    if name in spec.vectors or not sep or not feature.isdigit() or base not in spec.vectors or spec.vectors[base].sae is None:
        return None
    return base, int(feature)


def _steers_at(spec: SweepFile, name: str, at: tuple, chosen: dict) -> bool:
    """Whether vector `name` is in the grid at `at` = (site, layer, head): a `top` feature only where it was chosen."""
    found = feature_of(spec, name)
    if found is None or spec.vectors[found[0]].top is None:
        return True
    return found[1] in chosen.get((found[0], *at[:2]), ())


def _source(spec: SweepFile, name: str) -> VectorSource:
    """The source of a vector name (NAME-fN: NAME's, for feature N alone)."""
    found = feature_of(spec, name)
    if found is not None:
        return spec.vectors[found[0]].model_copy(update={"features": (found[1],)})
    return spec.vectors[name]


def _at_threshold(iv: Intervention, threshold: float | None) -> Intervention:
    if threshold is None:
        return iv
    gate = iv.condition.model_copy(update={"conditions": tuple(c.model_copy(update={"threshold": threshold}) for c in iv.condition.conditions)})
    return iv.model_copy(update={"condition": gate})


def _config(name: str, at: tuple, op: str, positions: str, alpha: float | None, loaded: tuple, where: str,
            threshold: float | None = None) -> Config:  # fmt: skip
    """One configuration: the vector `name` at `at` = (site, layer, head), as `loaded` (its Intervention, record),
    under the file's condition at `threshold` (None: unconditional)."""
    (site, layer, head), (base_iv, vrecord) = at, loaded
    iv: Intervention = base_iv.model_copy(update={"op": op, "positions": positions, "alpha": 1.0 if alpha is None else float(alpha)})
    iv = _at_threshold(iv, threshold)
    at_head = "" if head is None else f" head {head},"
    steering = _steering(iv, f"{where}: grid.alphas: {alpha:g} (vector {name}, layer {layer}, {site},{at_head} {op})")
    cid = f"{name}.{site}.L{layer}" + ("" if head is None else f".h{head}") + f".{op}.{positions}"
    cid += ("" if alpha is None else f".a{_fmt_alpha(alpha)}") + ("" if threshold is None else f".t{threshold:g}")
    written = {"layer": layer, "site": site, **({} if head is None else {"head": head}), "op": op, "positions": positions,
               "alpha": iv.alpha, "normalize": iv.normalize,
               "vector": {"source": name, **{k: vrecord[k] for k in ("path", "key")}}}  # fmt: skip
    if iv.condition is not None:
        c = iv.condition.conditions[0]
        written["condition"] = {"layers": list(c.layers), "threshold": c.threshold, "compare": c.compare, "pool": c.pool,
                                "vector": vrecord["conditions"][0]["path"]}  # fmt: skip
    record = {"source": str(Path(where).absolute()), "sweep_config": cid, "spec": {"interventions": [written]},
              "vectors": [vrecord], "key": steering.key(), "resolved_layers": [layer]}  # fmt: skip
    return Config(cid, steering, name, site, layer, op, positions, alpha, record, head, threshold)


def grid_configs(spec: SweepFile, layers: list[int], heads: list[int], model: Model, base: Path, where: str, chosen: dict,
                 loaded: dict | None = None) -> list[Config]:  # fmt: skip
    """The baseline, then every configuration of the grid (heads innermost, at a head site only; thresholds
    innermost of all); `top` sources only at the features `chosen` for each place. `loaded`: the vectors read by
    an earlier call, {(name, place): ...} (a `top` sweep expands again once its features are chosen)."""
    g = spec.grid
    configs = [Config(BASELINE, NO_STEERING)]
    loaded = {} if loaded is None else loaded
    for name, site, op, positions, layer in itertools.product(_vector_names(spec, where, chosen), g.sites, g.ops, g.positions, layers):
        for head in heads if site in HEAD_SITES else [None]:
            at = (site, layer, head)
            if not _steers_at(spec, name, at, chosen):
                continue
            if (name, at) not in loaded:  # each vector read and checked once, whatever the ops and positions
                loaded[(name, at)] = _load_vector(name, _source(spec, name), at, g.ops, model, base, where)
            alphas = [None] if op == "ablate" else [a for a in g.alphas if not (a == 0 and op in _IDENTITY_AT_ZERO)]
            configs += [_config(name, at, op, positions, alpha, loaded[(name, at)], where, t) for alpha in alphas for t in g.thresholds or [None]]
    return configs


def nonempty(grid: Grid, where: str) -> None:
    if all(op in _IDENTITY_AT_ZERO for op in grid.ops) and not any(grid.alphas):
        raise SweepError(
            f"{where}: grid: empty (every alpha is 0, which is the baseline for ops {', '.join(_IDENTITY_AT_ZERO)}): "
            "list nonzero alphas"
        )


def _requests(lm, prompts: Sequence) -> tuple[list, np.ndarray]:
    """Capture requests for every token but a leading BOS of each prompt as lm-eval tokenizes it (its last
    max_length tokens), and which prompt each reads."""
    from driver.steering.encoders import capture_requests

    return capture_requests([lm.tok_encode(p.text)[-lm.max_length :] for p in prompts], lm.prefix_token_id)


def _capture(lm, steering: Steering, points: Sequence[str], requests: list) -> np.ndarray:
    """[tokens, points, hidden]: the points captured on the workers under `steering` (cached as any job)."""
    from worker.spec import Job

    return np.stack(lm.executor.run(Job(kind="capture", steering=steering, points=tuple(points)), requests))


def choose_top(sweep, lm, echo=print) -> None:
    """Rank each `top` source's features by their mean activation on its prompts (captured at its site on the
    workers: every token but a leading BOS, each prompt weighing the same) and add the configurations of the K
    highest at each place; what was chosen goes into `sweep.top_features`."""
    from driver.steering.encoders import prompt_weights, ranked

    chosen: dict[tuple, list[int]] = {}
    sweep.top_features = []
    for file in dict.fromkeys(t.file for t in sweep.tops if t.k):
        tops = [t for t in sweep.tops if t.file == file and t.k]
        requests, owners = _requests(lm, tops[0].prompts)
        points = list(dict.fromkeys(f"{t.site}.{t.layer}" for t in tops))
        echo(f"sweep: ranking SAE features at {', '.join(points)} on {len(tops[0].prompts)} prompts of {Path(file).name} ({len(requests)} tokens)")
        acts = _capture(lm, NO_STEERING, points, requests)
        for t in tops:
            means = t.encoder.mean_activation(acts[:, points.index(f"{t.site}.{t.layer}")], prompt_weights(owners))
            top = ranked(means, t.k, f"vectors.{t.name}'s SAE at {t.site}.{t.layer}")
            chosen[(t.name, t.site, t.layer)] = [f for f, _ in top]
            sweep.top_features.append({"vector": t.name, "site": t.site, "layer": t.layer, "sae": str(t.encoder.path), "prompts": file,
                                       "n_prompts": len(tops[0].prompts), "tokens": len(requests),
                                       "features": [{"feature": f, "mean_activation": a} for f, a in top]})  # fmt: skip
            echo(f"sweep: vectors.{t.name} at {t.site}.{t.layer}: features " + ", ".join(f"{f} ({a:.3g})" for f, a in top))
    sweep.configs = sweep.expand(chosen)


FEATURE_ACTIVATION = "feature_activation"


def _measured(sweep, config) -> tuple[Any, int] | None:
    """(the TopAt of the SAE source `config` steers a feature of, at its place, the feature), or None."""
    found = feature_of(sweep.spec, config.vector or "")
    if found is None or config.steering.conditional:
        return None
    at = next((t for t in sweep.tops if (t.name, t.site, t.layer) == (found[0], config.site, config.layer)), None)
    return (at, found[1]) if at is not None else None


def measure_features(sweep, lm, echo=print) -> dict[int, list[dict]]:
    """{configuration index: its FEATURE_ACTIVATION row}: for each unconditional configuration steering a feature of an
    SAE source with `prompts:`, that feature's mean activation (the SAE's encoder) at its site on those prompts, under
    the configuration's steering as a capture of the prompts applies it (every token but a leading BOS, each prompt
    weighing the same; stderr over the prompts), and its change from the unsteered model's (`delta`)."""
    from driver.steering.encoders import per_prompt
    from driver.sweep.rows import mean_stderr

    todo = {c: m for c, config in enumerate(sweep.configs) if (m := _measured(sweep, config))}
    if todo:
        echo(f"sweep: measuring the steered feature's activation under {len(todo)} configurations")
    out, read, plain, before = {}, {}, {}, {}  # per SAE source: its prompts' tokens; per place: the unsteered capture
    for c, (at, feature) in todo.items():
        point, place = f"{at.site}.{at.layer}", (f"{at.site}.{at.layer}", at.file)
        if at.file not in read:
            read[at.file] = _requests(lm, at.prompts)
        requests, owners = read[at.file]
        if place not in plain:
            plain[place] = _capture(lm, NO_STEERING, [point], requests)[:, 0]
        if (place, feature) not in before:  # the unsteered value, once per feature (a top-k encoder reads W_enc)
            before[place, feature] = mean_stderr(per_prompt(at.encoder.feature(plain[place], feature), owners))[0]
        steered = _capture(lm, sweep.configs[c].steering, [point], requests)[:, 0]
        values = per_prompt(at.encoder.feature(steered, feature), owners)
        (value, stderr), ok = mean_stderr(values), bool(np.isfinite(values).all())
        out[c] = [{"task": Path(at.file).stem, "metric": FEATURE_ACTIVATION, "value": value if ok else None, "stderr": stderr if ok else None,
                   "n": len(values), "delta": value - before[place, feature] if ok else None, "error": None if ok else "non-finite activation"}]  # fmt: skip
    return out
