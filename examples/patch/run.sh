#!/usr/bin/env bash
# Which position and head copy the object into the answer? Activation patching on TinyStories-260K, offline, in
# one command (about a minute on a laptop): 8 pairs "Lily had a red ball. Lily loved her red" -> " ball" against the
# same story with another object, sites resid_pre / attn_out / mlp_out / attn_head, every layer and position,
# exact and attribution, on WORKERS local workers.
# Outputs in examples/patch/out/: summary.md, results.csv, pairs.jsonl, run.json, plots/*.png.
# Run it from anywhere with the project's virtual environment active (or PYTHON=/path/to/python).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python}"
workers="${WORKERS:-2}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$python" -m driver patch "$here/patch.yaml" --workers "$workers" --address local --threads 1 --output "$here/out"
echo "see $here/out/summary.md and $here/out/plots/"
