#!/bin/sh
# Language models trained for retrieval (docs/text_results.md, "Retrieval"; not shipped): the text mixed with
# retrieval examples of the trained split (composed wordings, up to 4 needles, half of the draws varied), pass keys
# and MQAR rows, in stages, each run in calls of at most BUDGET seconds of training that go on from where the last
# one stopped (`text-train --resume`); a call prints "done" when the last stage has ended.
#
# ARCH=delta (default): LRNN with the delta rule and its short convolution (2 layers of 8 heads of 16, d128,
# d_ff 512), from scratch.
#   1. windows of 256, batch 32, lr 1e-3 constant, 6,000 steps [runs/delta-conv-1];
#   2. windows of 1,024, batch 16, state passing, examples in one window started from the initial state, retrieval
#      and pass-key examples spanning up to 8 windows (8,192 tokens; --recall-span, --passkey-span), lr 3e-4
#      constant, 3,000 steps [runs/delta-conv-2 ran it from stage 1's step 2,516 with --steps 1400 to step 1,182:
#      below stage 1's own figures; stage 1 first needs its 6,000 steps].
# ARCH=regulargpt: RegularGPT C = 64, K = 4 (checkpoints/text-regulargpt's shape), from that checkpoint.
#   1. as the delta model's stage 1 [runs/rg-recall-1, to step 510 so far];
#   2. windows of 1,024, batch 8, lr 3e-4 constant, 2,000 steps (no state to carry) [not run yet].
#
# One thread on the 2-core development CPU, beside another run: delta stage 1 ~2.1 s a step, stage 2 ~5 s,
# RegularGPT's stage 1 ~6.7 s.
# OUT=folder prefix (default runs/text-retrieval-ARCH: stages in OUT-1, OUT-2), BUDGET (default 540), DEVICE
# (default auto), PYTHON, TO=last stage (default 2). More train flags go to every stage when it starts (last, so they
# win; a stage resumed keeps the flags it started with), e.g. --d-model 256 --threads 2.
# Evaluate with: python -m training text-eval --checkpoint OUT-N --probe retrieval --sizes 1k,8k,32k --split both
# (held-out split apart), and --needles 4 --split trained.
# Needs the `text` extra and the corpus (apt-get install r-cran-janeaustenr).
set -eu
ARCH=${ARCH:-delta}
OUT=${OUT:-runs/text-retrieval-$ARCH}
BUDGET=${BUDGET:-540}
DEVICE=${DEVICE:-auto}
PYTHON=${PYTHON:-python}
TO=${TO:-2}
. recipes/resumable.sh

MIX="--recall-fraction 0.5 --recall-needles 4 --recall-varied 0.5 --passkey-fraction 0.1 --mqar-fraction 0.6"
COMMON="--tokenizer checkpoints/text-lrnn/tokenizer.tiktoken --corpus austen --schedule constant --eval-every 250 \
    --save-every 50 --log-every 10 --threads 1 --no-progress --device $DEVICE $MIX"
case "$ARCH" in
delta)
    MODEL="--arch lrnn --transition-norm delta --short-conv 4 --layers 2 --block-size 16 --num-blocks 8 \
        --d-model 128 --d-ff 512"
    INIT=""
    SECOND="--length 1024 --batch-size 16 --state-passing --passkey-fresh --recall-span 8 --passkey-span 8 \
        --steps 3000"
    ;;
regulargpt)
    MODEL="--arch regulargpt --chunk-size 64 --thickness 4 --heads 4 --attention-impl auto --d-model 128 --d-ff 512"
    INIT="--init-from checkpoints/text-regulargpt"
    SECOND="--length 1024 --batch-size 8 --steps 2000"
    ;;
*)
    echo "ARCH is delta or regulargpt, not $ARCH" >&2
    exit 2
    ;;
esac

stage() {  # stage N FLAGS...: this call's share of stage N (resumable's status)
    n=$1
    shift
    # shellcheck disable=SC2086
    resumable "$OUT-$n" "$PYTHON" -m training text-train $MODEL $COMMON "$@" --out "$OUT-$n" $EXTRA
}
EXTRA="$*"

# shellcheck disable=SC2086
stage 1 --length 256 --batch-size 32 --lr 1e-3 --warmup-steps 50 --steps 6000 $INIT || after $?
[ "$TO" -ge 2 ] || { echo "done"; exit 0; }
# shellcheck disable=SC2086
stage 2 $SECOND --lr 3e-4 --warmup-steps 20 --init-from "$OUT-1" || after $?
echo "done"
