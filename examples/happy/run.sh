#!/usr/bin/env bash
# The happy/sad steering study, offline, in one command (403 s on a loaded 2-core Linux box, most of it the judge):
#   1. `driver vectors`: a "happy" direction per layer of TinyStories-260K from 32 contrastive story pairs;
#   2. `driver sweep`: add it at each of the 5 layers with 6 strengths on 12 story prompts, on WORKERS local workers,
#      beside a prompting baseline, "best" chosen on held-out prompts, every story rated by a judge (sweep.yaml).
# Outputs in examples/happy/out/: summary.md, results.csv, generations.jsonl, samples.jsonl, steerability.csv, plots/*.png.
# Run it from anywhere with the project's virtual environment active (or PYTHON=/path/to/python).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python}"
workers="${WORKERS:-2}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)
"$python" -m driver vectors --model "$here/../stories260K" --pairs "$here/pairs.jsonl" --layers all \
    --workers 1 --address local --threads 1 --out "$here/out/happy.safetensors"
"$python" -m driver sweep "$here/sweep.yaml" --workers "$workers" --address local --threads 1 --output "$here/out"
echo "happy study done in $(( $(date +%s) - start )) s: see $here/out/summary.md"
