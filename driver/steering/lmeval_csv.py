"""lm-eval's `steered` CSV files, as they are, read into a steering spec of SAE features.

    loader,action,sparse_model,hookpoint,feature_index,steering_coefficient,head_index,sae_id,description
    sparsify,clamp,saes/pythia-70m,layers.3,30,10.0,,,
    sae_lens,add,saes/gemma-scope,layers.20,12082,240.0,,layer_20/width_16k/canonical,increase dogs

How each row is read (lm-eval's `hf_steered.py` is the reference):
- `sparse_model`: a local folder, relative to the working directory as lm-eval reads it (else to the CSV's
  folder). sparsify: the SAE is `sparse_model/hookpoint`; sae_lens: `sparse_model/sae_id` (or `sparse_model`
  itself when it holds the SAE). Orchard does not download: fetch SAEs from the Hub first.
- `hookpoint`: lm-eval's module names, `layers.L` (the block's output: resid_post), `layers.L.self_attn` (the
  attention's output after o_proj: attn_out), `layers.L.mlp` (mlp_out); empty for sae_lens means the SAE's
  own `hook_name`. With `head_index` h at `layers.L.self_attn` the row steers head h alone (attn_head: that
  head's output before o_proj), with a head_dim-wide feature; lm-eval's CSV reader drops head_index.
- `add`: x + coefficient * W_dec[feature] (b_dec is not used; lm-eval refuses its own CSV here: its reader
  always passes b_dec and its add asserts there is none).
- `clamp`: as lm-eval, about b_dec: x - b_dec, its projection on u = W_dec[feature]/|W_dec[feature]| set to the
  coefficient, b_dec added back; Orchard's clamp to coefficient + b_dec·u, which is the same edit.
- Two rows at one hookpoint: lm-eval silently keeps the last; Orchard refuses the file.
Every problem is one line naming the file, the row (its line) and the column.
"""

from __future__ import annotations

import csv
import difflib
import math
from pathlib import Path

from worker.spec import SteeringError

from driver.checks.settings import as_written
from driver.steering.saes import HOOKPOINTS, site_of

COLUMNS = ("loader", "action", "sparse_model", "hookpoint", "feature_index", "steering_coefficient", "head_index", "sae_id",
           "description")  # fmt: skip
REQUIRED = ("sparse_model", "feature_index", "steering_coefficient")
LOADERS = ("sparsify", "sae_lens")
ACTIONS = ("add", "clamp")


def _fail(path: Path, line: int | None, column: str, problem: str) -> SteeringError:
    at = f"line {line}: " if line else ""
    col = f"{column}: " if column else ""
    return SteeringError(" ".join(f"{path}: {at}{col}{problem}".split()))


def _header(path: Path, names: list[str]) -> list[str]:
    names = [n.strip() for n in names]
    while names and names[-1] == "":  # lm-eval's own example header ends with a comma
        names.pop()
    for name in names:
        if name not in COLUMNS:
            near = difflib.get_close_matches(name, COLUMNS, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise _fail(path, 1, "", f"unknown column {name!r} ({hint}lm-eval's steered CSV has: {', '.join(COLUMNS)})")
    missing = [c for c in REQUIRED if c not in names]
    if missing:
        raise _fail(path, 1, "", f"no column {missing[0]!r} (lm-eval's steered CSV needs {', '.join(REQUIRED)})")
    return names


def _number(path: Path, line: int, column: str, text: str, whole: bool) -> float | int | None:
    if text == "":
        return None
    written = as_written(text)  # ASCII digits, as the flags read numbers (float() takes "1_0", "٧", "nan")
    value = float(written) if written is not None else math.nan
    if not math.isfinite(value) or (whole and (value != int(value) or value < 0)):
        kind = "a whole number of 0 or more" if whole else "a finite number"
        raise _fail(path, line, column, f"{text!r} is not {kind}")
    return int(value) if whole else value


def _folder(path: Path, text: str) -> Path:
    given = Path(text).expanduser()
    if given.is_absolute() or given.exists():
        return given.absolute()
    return path.absolute().parent / given


def _row(path: Path, line: int, row: dict[str, str]) -> dict:
    """One CSV row as a spec intervention (a dict `driver.steering.schema` validates)."""
    loader = row.get("loader") or "sparsify"
    if loader not in LOADERS:
        raise _fail(path, line, "loader", f"{loader!r} is not a loader Orchard reads (use one of: {', '.join(LOADERS)})")
    action = row.get("action") or "add"
    if action not in ACTIONS:
        raise _fail(path, line, "action", f"{action!r} is not an action of lm-eval's steered model (use add or clamp)")
    for column in REQUIRED:
        if not row.get(column):
            raise _fail(path, line, column, "is empty")
    feature = _number(path, line, "feature_index", row["feature_index"], whole=True)
    alpha = _number(path, line, "steering_coefficient", row["steering_coefficient"], whole=False)
    head = _number(path, line, "head_index", row.get("head_index") or "", whole=True)
    hookpoint, folder = row.get("hookpoint") or "", _folder(path, row["sparse_model"])
    if loader == "sparsify":
        if not hookpoint:
            raise _fail(path, line, "hookpoint", "is empty: a sparsify row names its hookpoint (the SAE's folder)")
        sae = folder / hookpoint
    else:
        sae = folder / row["sae_id"] if row.get("sae_id") and (folder / row["sae_id"]).is_dir() else folder
        if not hookpoint:
            from driver.steering.saes import SaeError, read_sae

            try:
                hookpoint = read_sae(sae).hook_name or ""
            except SaeError as e:
                raise _fail(path, line, "sparse_model", str(e)) from None
            if not hookpoint:
                raise _fail(path, line, "hookpoint", f"is empty and the SAE at {sae} names no hook_name: give the hookpoint")
    at = site_of(hookpoint)
    if at is None:
        raise _fail(path, line, "hookpoint", f"{hookpoint!r} is not a hook point Orchard knows (use {HOOKPOINTS})")
    site, layer = at
    if head is not None:
        if site != "attn_out":
            raise _fail(path, line, "head_index", f"applies to an attention hookpoint (layers.L.self_attn), not {hookpoint!r}")
        site = "attn_head"
    vector = {"sae": str(sae), "feature": feature, "about_b_dec": action == "clamp"}
    return {"layer": layer, "site": site, "op": action, "alpha": alpha, "vector": vector, **({} if head is None else {"head": head})}


def read_csv(path: str | Path) -> tuple[dict, list[int], list[str]]:
    """({interventions: [...]}, the CSV line of each, its description) from an lm-eval steered CSV file."""
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise _fail(path, None, "", "no such file (check the path)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise _fail(path, None, "", f"cannot read the file ({type(e).__name__}: {e})") from None
    reader = csv.reader(text.splitlines())
    rows = [(n, r) for n, r in enumerate(reader, 1) if any(cell.strip() for cell in r)]
    if not rows:
        raise _fail(path, None, "", f"is empty: write the header ({','.join(COLUMNS)}) and one row per feature")
    names = _header(path, rows[0][1])
    interventions, lines, notes, seen = [], [], [], {}
    for line, cells in rows[1:]:
        extra = [c for c in cells[len(names):] if c.strip()]
        if extra:
            raise _fail(path, line, "", f"has {len(cells)} values but the header names {len(names)} columns")
        row = {name: (cells[i].strip() if i < len(cells) else "") for i, name in enumerate(names)}
        iv = _row(path, line, row)
        where = (iv["site"], iv["layer"], iv.get("head"))
        if where in seen:
            raise _fail(path, line, "hookpoint", f"steers the same place as line {seen[where]} (lm-eval would keep only the "
                        "last of them, silently): keep one row per hookpoint")  # fmt: skip
        seen[where] = line
        interventions.append(iv)
        lines.append(line)
        notes.append(row.get("description", ""))
    if not interventions:  # lm-eval would run it unsteered
        raise _fail(path, None, "", "has a header but no rows: add one row per feature to steer")
    return {"interventions": interventions}, lines, notes


_COLUMN_OF = {"vector.sae": "sparse_model", "vector.feature": "feature_index", "vector.about_b_dec": "action",
              "vector": "feature_index", "alpha": "steering_coefficient", "layer": "hookpoint", "site": "hookpoint",
              "head": "head_index"}  # fmt: skip


def in_rows(message: str, lines: list[int]) -> str:
    """A spec error about `interventions[i].field` said as the CSV's `line N: column`."""
    import re

    for field, column in _COLUMN_OF.items():
        message = re.sub(rf"(interventions\[\d+\])\.{re.escape(field)}:", rf"\1.{column}:", message)
    return re.sub(r"interventions\[(\d+)\]\.?", lambda m: f"line {lines[int(m.group(1))]}: " if int(m.group(1)) < len(lines)
                  else m.group(0), message)  # fmt: skip


def said_at_rows(where: str, message: str) -> str:
    """A model-shape refusal of a CSV's row (`where` is a CSV file) said at its line and column (`in_rows`)."""
    return in_rows(message, read_csv(where)[1]) if where.lower().endswith(".csv") else message
