#!/bin/sh
# The probes of docs/text_results.md's "Training for the pass key: where it stands", for language-model checkpoints:
#   after   2 numbers between the needle and the question, 1k tokens, Austen filler (24 prompts, quickest)
#   ppl     last-token perplexity with 128 ... 8,192 tokens of context (the same 128 held-out targets)
#   num4    4 other numbers in the filler, 1k and 8k tokens, Austen and grass (80 prompts)
#   greedy  1k, 8k and 64k tokens, Austen and grass (120 prompts; the 64k prompts take most of the time)
# each into $REPORTS/NAME-PROBE/ (REPORTS default runs/eval), with its table on stdout.
#
#   recipes/probe-text.sh checkpoints/text-lrnn [more folders]
#   PROBES="after ppl" recipes/probe-text.sh runs/x     # some of them
#
# Extra flags for `python -m training text-eval` (e.g. --threads 2) go in EVAL_FLAGS.
set -eu
[ $# -ge 1 ] || { echo "usage: recipes/probe-text.sh CHECKPOINT_DIR [...]" >&2; exit 2; }
PYTHON=${PYTHON:-python}
REPORTS=${REPORTS:-runs/eval}
PROBES=${PROBES:-after ppl num4 greedy}
for checkpoint in "$@"; do
    name=$(basename "$checkpoint")
    for probe in $PROBES; do
        case $probe in
            after) flags="--probe passkey --sizes 1k --depths 0.25,0.5,0.75 --filler austen --trials 8 \
                --distractors 2 --distractors-at after" ;;
            ppl) flags="--train-length 128 --multiples 1,2,4,8,16,64 --targets 128 --batch-size 8" ;;
            num4) flags="--probe passkey --sizes 1k,8k --filler austen,grass --trials 4 --distractors 4" ;;
            greedy) flags="--probe passkey --sizes 1k,8k,64k --filler austen,grass --trials 4" ;;
            *) echo "unknown probe '$probe': after, ppl, num4 or greedy" >&2; exit 2 ;;
        esac
        # shellcheck disable=SC2086
        "$PYTHON" -m training text-eval --checkpoint "$checkpoint" $flags --threads 1 --no-progress \
            --out "$REPORTS/$name-$probe" ${EVAL_FLAGS:-}
    done
done
