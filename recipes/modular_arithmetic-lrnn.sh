#!/bin/sh
# Recipe of checkpoints/modular_arithmetic-lrnn: LRNN with spectral-norm transitions (column p = 2), 3 layers of 8
# blocks of 2, d32, d_ff 64, lengths 1-40 (the protocol's recipe of docs/results.md, seed 0); then 2,000 steps more
# on strings whose operators are "*" with a probability each draws from 0.33-0.95 (--p-times: long products, which
# uniform strings of 1-40 symbols rarely hold); then state codes (python -m training snap): each block's state
# snapped to the nearest state it visits at lengths 1-40, after every 8th symbol.
#
# The commands recorded in checkpoints/modular_arithmetic-lrnn/config.json (metadata.command of the two training
# runs and metadata.state_codes.command), but for --out and --init-from.
#
# Figures: docs/results.md, "modular_arithmetic".
#
# Run from the repository root: recipes/modular_arithmetic-lrnn.sh [more flags for the first training run, which
# override the recipe's]. OUT=folder (default runs/modular_arithmetic-lrnn; the training runs write $OUT-trained
# and $OUT-products first; a folder holding a checkpoint is refused), PYTHON=interpreter.
# Evaluate: recipes/evaluate.sh runs/modular_arithmetic-lrnn
set -eu
OUT=${OUT:-runs/modular_arithmetic-lrnn}
MODEL="--task modular_arithmetic --arch lrnn --transition-norm spectral --p-norm 2 --block-size 2 --d-model 32
    --d-ff 64 --batch-size 128 --schedule cosine --optimizer adamw --weight-decay 0 --eval-every 500
    --eval-samples 200 --layers 3 --num-blocks 8 --seed 0 --threads 1 --no-progress"
# shellcheck disable=SC2086  # MODEL is a list of flags
"${PYTHON:-python}" -m training train $MODEL --lr 3e-3 --steps 6000 --out "$OUT-trained" "$@"
# shellcheck disable=SC2086
"${PYTHON:-python}" -m training train $MODEL --lr 1e-3 --warmup-steps 50 --steps 2000 --p-times 0.33-0.95 \
    --init-from "$OUT-trained" --out "$OUT-products"
exec "${PYTHON:-python}" -m training snap --checkpoint "$OUT-products" --out "$OUT" --threads 1
