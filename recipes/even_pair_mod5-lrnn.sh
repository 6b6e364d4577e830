#!/bin/sh
# Recipe of checkpoints/even_pair_mod5-lrnn: stochastic LRNN (softmax columns for the first 1,500 steps, then the
# sparsemax), one layer of 2 blocks of 6.
#
# The command recorded in checkpoints/even_pair_mod5-lrnn/config.json (metadata.command), but for --out
# runs/even_pair_mod5-lrnn-sto2-s0 and --harden-steps 0 (the switch at once these weights had; the default now blends).
# Trained in 76 s of wall time on the development CPU, 2026-11-23 evening.
#
# Figures: docs/results.md, "Shipped trained checkpoints".
#
# Run from the repository root: recipes/even_pair_mod5-lrnn.sh [more train flags, which override the recipe's].
# OUT=folder (default runs/even_pair_mod5-lrnn; a folder holding a checkpoint is refused), PYTHON=interpreter.
# Evaluate: recipes/evaluate.sh runs/even_pair_mod5-lrnn
set -eu
OUT=${OUT:-runs/even_pair_mod5-lrnn}
exec "${PYTHON:-python}" -m training train \
    --task even_pair_mod5 --arch lrnn --transition-norm stochastic --layers 1 --block-size 6 --num-blocks 2 \
    --d-model 32 --d-ff 64 --batch-size 128 --lr 3e-3 --optimizer adamw --weight-decay 0 --schedule cosine \
    --steps 3000 --harden-steps 0 --p-one 0-1 --eval-every 250 --eval-samples 200 --seed 0 --no-progress \
    --out "$OUT" "$@"
