#!/bin/sh
# The two protocols of docs/results.md on transducer checkpoints: "papers" (final-label accuracy on lengths 41-500,
# 51-100 for the d* and tomita* tasks) and "hard" (501-2000 with the task's generator, then with P(1) = 0.1 and 0.9),
# 200 fresh strings per band (10 bands per column), then one table row per checkpoint
# (benchmarks/accuracy/results_table.py).
#
#   recipes/evaluate.sh checkpoints/parity_check-lrnn [more folders]   the draw (SEED=1)
#   SEED=2 recipes/evaluate.sh checkpoints/*-lrnn                        a second fresh draw
#
# The JSON reports go to $REPORTS (default runs/eval) as NAME-papers-sSEED.json and NAME-hard-sSEED.json.
# Extra flags for `python -m training eval` (e.g. --device cuda, --threads 1) go in EVAL_FLAGS.
set -eu
[ $# -ge 1 ] || { echo "usage: recipes/evaluate.sh CHECKPOINT_DIR [...]" >&2; exit 2; }
PYTHON=${PYTHON:-python}
SEED=${SEED:-1}
REPORTS=${REPORTS:-runs/eval}
mkdir -p "$REPORTS"
made=""
for checkpoint in "$@"; do
    name=$(basename "$checkpoint")
    for protocol in papers hard; do
        report="$REPORTS/$name-$protocol-s$SEED.json"
        # shellcheck disable=SC2086  # EVAL_FLAGS is a list of flags
        "$PYTHON" -m training eval --checkpoint "$checkpoint" --protocol "$protocol" --samples 200 --seed "$SEED" \
            --json ${EVAL_FLAGS:-} > "$report"
        made="$made $report"
    done
done
# shellcheck disable=SC2086
exec "$PYTHON" -m benchmarks.accuracy.results_table $made
