#!/bin/sh
# Recipe of checkpoints/text-lrnn (shipped since 2026-11-30): a language model that keeps a pass key (docs/api.md,
# Long-context probes), also where other numbers come after it. LRNN with stochastic transitions, 2 layers of 16 blocks of 16 (state
# 256 a layer), d_model 128, d_ff 512, on the Austen corpus with the shipped 8k BPE. Its last two stages are taught
# by Q, the text-lrnn shipped before it (16 blocks of 8: recipes/text-lrnn-q.sh, weights in
# recipes/stages/text-lrnn-q; Q answers with the last number it read, even inside one window): `--teacher`, the
# loss on text rows a mix of the corpus's next token and Q's distribution. Figures: docs/text_results.md, "Shipped
# text models" and "Training for the pass key: where it stands"; each stage's runs in docs/log/text-results-2026-11.md,
# "Training for the pass key, stage by stage" and the sections after it.
# Stages, each started from the last one's weights (--init-from); the run names of the docs in brackets:
#
#   1. pass-key rows only, 4,000 steps at lr 1e-3 (3e-3 never learned the key on this shape), softmax columns for
#      the first 2,000, then sparsemax [runs/pk16-lr1e-3];
#   2. text mixed in: the pass-key share falling from 1.0 to 0.2 over 4,500 steps, lr 1e-3, no state passing (state
#      passing from this stage lost the key at once) [A3];
#   3. windows of 512, 30% pass-key rows with up to 8 distractor numbers, 1,000 steps at lr 3e-4 [W8];
#   4. the same, 600 steps, up to 4 distractors in prose number forms (--passkey-number-forms) [W8F];
#   5. state passing, a quarter of the rows restarted each step, and the rows given a pass-key example started from
#      the initial state (--passkey-fresh), lr 1e-4 constant, 600 steps [W8FSF];
#   (6. the same with half the rows pass-key examples, 2,400 steps, was run only in the first build of this lineage,
#      as W8FSF2-4; the shipped chain goes from stage 5 to stage 7, which starts from stage 5's folder;)
#   7. windows of 2,048 with the whole gradient through them, batch 16, state passing with fresh pass-key rows, lr
#      3e-4 constant, 1,000 steps (16.7 M scored tokens, the scale of Q's stage 9 at its step 1,000), taught by Q
#      at weight 0.5 (recipes/stages/text-lrnn-b16-7-taught, [b16-7d]); ~1 h 50 min on the development CPU's two
#      threads untaught, about twice that taught (Q's forward pass on every text row), ~a minute on an H100;
#   8. windows of 512 (batch 16), the same mix, taught at weight 1 (Q's distribution alone on the text rows), lr
#      3e-4 constant, 758 steps [b16-7dw1s: started with --steps 1200 --eval-every 200 and stopped by a signal at
#      step 758, whose weights `python -m training export` wrote; they are checkpoints/text-lrnn].
#
# Wall times on the 2-core development CPU, one thread beside another job unless said (2026-11-29/30): stages 1-4
# 2,452 s, 3,181 s, 1,435 s and 744 s; stage 5 663 s on two threads; stage 7 taught 12,060 s on two threads; stage 8
# taught 3,714 s on one thread. Weights kept in recipes/stages/: the teacher (text-lrnn-q) and stage 7's start
# (text-lrnn-b16-7-taught, which recipes/text-lrnn-b16-taught.sh loads). The other stages' weights are in the
# repository's history: `git log --diff-filter=D --stat -- recipes/stages` names the commit that removed them.
# recipes/text-lrnn-b16-taught.sh runs stages 7 and 8 taught at the scale of Q's stage 9 (~7,000 steps of 2,048
# tokens), on a GPU, in resumable calls: the next step toward perplexity that falls with context
# (docs/text_results.md). The runs' own folders, while they last, go on with
#   python -m training text-train --resume --out runs/b16-7dw1s --threads 2 --no-progress
#
# Needs the `text` extra and the corpus (apt-get install r-cran-janeaustenr).
# Run from the repository root: recipes/text-lrnn.sh [more train flags for every stage].
# OUT=folder prefix (default runs/text-lrnn: stages in runs/text-lrnn-1 .. -8), PYTHON=interpreter,
# DEVICE=where stage 7 runs (default auto: a GPU if there is one), TEACHER=the teacher of stages 7 and 8 (default
# recipes/stages/text-lrnn-q). FROM=first stage to run (default 1; a later one starts from the folder of the stage
# before it, or from INIT=folder), TO=last stage to run (default 8).
# Evaluate with recipes/probe-text.sh (the probes of docs/text_results.md: --sizes 1k,8k,64k --filler austen,grass
# --trials 4, and --sizes 1k,8k --trials 4 --distractors 4) and
#   EVAL_FLAGS="--train-length 128" recipes/evaluate-text.sh runs/text-lrnn-8
set -eu
OUT=${OUT:-runs/text-lrnn}
PYTHON=${PYTHON:-python}
DEVICE=${DEVICE:-auto}
FROM=${FROM:-1}
TO=${TO:-8}
INIT=${INIT:-}
TEACHER=${TEACHER:-recipes/stages/text-lrnn-q}
MODEL="--arch lrnn --transition-norm stochastic --layers 2 --block-size 16 --num-blocks 16 --d-model 128 \
    --d-ff 512 --tokenizer checkpoints/text-lrnn/tokenizer.tiktoken --corpus austen --length 128 --batch-size 16 \
    --eval-every 250 --log-every 10 --threads 1 --no-progress"
LATER="--soft-transition-steps 0 --passkey-distractors 4 --passkey-number-forms"  # stages 4-8
PASSING="--state-passing --state-reset 0.25 --passkey-fresh"  # stages 5-8

stage() {  # stage N FLAGS...: runs stage N (from the stage before its folder) unless N < FROM or N > TO
    n=$1
    shift
    { [ "$n" -lt "$FROM" ] || [ "$n" -gt "$TO" ]; } && return 0
    init=""
    before=$((n - 1))
    [ "$n" -eq 7 ] && before=5  # the shipped chain has no stage 6
    [ "$n" -gt 1 ] && init="--init-from $OUT-$before"
    [ "$n" -eq "$FROM" ] && [ -n "$INIT" ] && init="--init-from $INIT"
    # shellcheck disable=SC2086
    "$PYTHON" -m training text-train $MODEL "$@" $init --out "$OUT-$n" $EXTRA
}
EXTRA="$*"

stage 1 --lr 1e-3 --steps 4000 --harden-steps 0 --passkey-fraction 1.0 --passkey-distractors 0  # as shipped
stage 2 --lr 1e-3 --warmup-steps 100 --soft-transition-steps 0 --steps 4500 --passkey-fraction 1.0 \
    --passkey-fraction-final 0.2 --passkey-distractors 2
stage 3 --length 512 --batch-size 8 --lr 3e-4 --warmup-steps 50 --soft-transition-steps 0 --steps 1000 \
    --passkey-fraction 0.3 --passkey-distractors 8
# shellcheck disable=SC2086
stage 4 --length 512 --batch-size 8 --lr 3e-4 --warmup-steps 20 --steps 600 --eval-every 300 \
    --passkey-fraction 0.3 $LATER
# shellcheck disable=SC2086
stage 5 --length 512 --batch-size 8 $PASSING --lr 1e-4 --schedule constant --warmup-steps 50 --steps 600 \
    --passkey-fraction 0.3 $LATER
# shellcheck disable=SC2086
stage 7 --length 2048 --batch-size 16 $PASSING --lr 3e-4 --schedule constant --warmup-steps 20 --steps 1000 \
    --eval-every 200 --passkey-fraction 0.5 --device "$DEVICE" --dtype float32 $LATER \
    --teacher "$TEACHER" --teacher-weight 0.5
# shellcheck disable=SC2086
stage 8 --length 512 --batch-size 16 $PASSING --lr 3e-4 --schedule constant --warmup-steps 20 --steps 758 \
    --eval-every 200 --passkey-fraction 0.5 $LATER --teacher "$TEACHER" --teacher-weight 1.0
