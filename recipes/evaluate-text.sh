#!/bin/sh
# Last-token perplexity of language-model checkpoints against context length, as in docs/text_results.md: the same
# 128 held-out target tokens at 1x, 2x, 4x, 8x and 16x the training length (128), and the receptive-field curve over
# 16 windows of 4x the training length. The reports go to $REPORTS/NAME/eval.json (REPORTS default runs/eval).
#
#   recipes/evaluate-text.sh checkpoints/text-lrnn [more folders]
#
# Extra flags for `python -m training text-eval` (e.g. --device cuda) go in EVAL_FLAGS.
set -eu
[ $# -ge 1 ] || { echo "usage: recipes/evaluate-text.sh CHECKPOINT_DIR [...]" >&2; exit 2; }
PYTHON=${PYTHON:-python}
REPORTS=${REPORTS:-runs/eval}
mkdir -p "$REPORTS"
for checkpoint in "$@"; do
    name=$(basename "$checkpoint")
    # shellcheck disable=SC2086
    "$PYTHON" -m training text-eval --checkpoint "$checkpoint" --multiples 1,2,4,8,16 --targets 128 --batch-size 8 \
        --receptive-field 16 --receptive-multiple 4 --threads 1 --no-progress --out "$REPORTS/$name" \
        ${EVAL_FLAGS:-}
done
