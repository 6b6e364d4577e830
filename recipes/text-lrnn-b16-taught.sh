#!/bin/sh
# Stages 7 and 8 of the shipped text-lrnn (recipes/text-lrnn.sh, taught by Q, recipes/stages/text-lrnn-q) at the
# scale after which Q's own perplexity fell with context: ~7,000 steps of 2,048-token windows, then the 512-token
# stage that gave checkpoints/text-lrnn its keys (docs/text_results.md, "Training for the pass key: where it
# stands"). A GPU job (~10 minutes on an H100; ~20 hours on two CPU threads), cut into calls of
# at most BUDGET seconds of training, as the device tool's 10-minute commands need: each call goes on from where the
# last one stopped (`text-train --resume`), from stage 7 to stage 8, and prints "done" when both have ended.
# On the device machine, whose own $OUT is the folder that comes back, give OUT= on the command line, copy the
# stages' folders into the device's $OUT after each call, and carry them to the next (the device tool's `carry`):
#
#   DEVICE=cuda OUT=runs/b16t recipes/text-lrnn-b16-taught.sh; cp -r runs/b16t-* "$OUT"/  # until it prints "done"
#
# INIT=stage 7's start (default recipes/stages/text-lrnn-b16-7-taught), TEACHER=the teacher (Q),
# WEIGHT7=stage 7's --teacher-weight (1.0), STEPS7 (7000), STEPS8 (758), BUDGET=seconds of training per call (540),
# PYTHON. More train flags go to both stages when they start (last, so they win); a stage resumed in a later call
# keeps the flags it started with. Evaluate with recipes/probe-text.sh.
set -eu
OUT=${OUT:-runs/text-lrnn-b16-taught}
INIT=${INIT:-recipes/stages/text-lrnn-b16-7-taught}
TEACHER=${TEACHER:-recipes/stages/text-lrnn-q}
WEIGHT7=${WEIGHT7:-1.0}
STEPS7=${STEPS7:-7000}
STEPS8=${STEPS8:-758}
BUDGET=${BUDGET:-540}
DEVICE=${DEVICE:-auto}
PYTHON=${PYTHON:-python}
export PYTHON DEVICE OUT TEACHER
. recipes/resumable.sh

stage() {  # stage N INIT STEPS FLAGS...: this call's share of stage N (resumable's status)
    n=$1 init=$2 steps=$3
    shift 3
    resumable "$OUT-$n" env FROM="$n" TO="$n" INIT="$init" recipes/text-lrnn.sh --steps "$steps" "$@"
}

stage 7 "$INIT" "$STEPS7" --teacher-weight "$WEIGHT7" --eval-every 1000 --save-every 100 "$@" || after $?
stage 8 "$OUT-7" "$STEPS8" --device "$DEVICE" "$@" || after $?  # recipes/text-lrnn.sh's stage 8, on DEVICE
echo "done"
