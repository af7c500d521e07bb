#!/usr/bin/env bash
# SAE features and conditional steering (CAST) on TinyStories-260K, offline, in one command (a few minutes at most):
#   1. fit_sae.py: a 128-feature ReLU SAE on layer 3's input, saved as sae-lens saves one; the sweep and CAST specs;
#   2. `driver sweep out/sweep.yaml`: the SAE's 3 most active features on the task prompts (`top: 3`, ranked by the
#      sweep on the workers) x 4 strengths on 12 story prompts (tables, plots, summary.md's Top features);
#   3. `driver run --steer out/cast.yaml`: a feature added only on prompts that pass a CAST condition, on two tasks:
#      the table's `fired` row says how many rows the condition steered per task;
#   4. `driver sweep out/thresholds.yaml`: that condition at 3 thresholds (grid.thresholds) on the two tasks:
#      summary.md's Condition table gives the fire rate per threshold and task.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python}"
workers="${WORKERS:-1}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)
"$python" "$here/fit_sae.py"
"$python" -m driver sweep "$here/out/sweep.yaml" --workers "$workers" --address local --threads 1 --output "$here/out/sweep"
model="$(cd "$here/../stories260K" && pwd)"
PYTHONPATH="$here/../..${PYTHONPATH:+:$PYTHONPATH}" "$python" -c "from testbed.stories import write_story_tasks; write_story_tasks('$here/out/tasks')"
"$python" -m driver run --model "$model" --tasks tinystories_mc,tinystories_gen --include-path "$here/out/tasks" \
    --steer "$here/out/cast.yaml" --workers 1 --address local --threads 1 --output-path "$here/out/cast"
"$python" -m driver sweep "$here/out/thresholds.yaml" --workers "$workers" --address local --threads 1 --output "$here/out/thresholds"
sed -n '/^## Condition/,/^## /p' "$here/out/thresholds/summary.md" | sed '$d'
echo "CAST example done in $(( $(date +%s) - start )) s: see $here/out/sweep/summary.md, $here/out/thresholds/summary.md and the tables above"
