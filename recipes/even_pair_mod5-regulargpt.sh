#!/bin/sh
# Recipe of checkpoints/even_pair_mod5-regulargpt: RegularGPT d64, C = 2, dropout 0.1, P(1) drawn from [0.1, 0.9]
# per string, 16,000 steps, seed 16.
#
# The command recorded in checkpoints/even_pair_mod5-regulargpt/config.json (metadata.command), but for --out
# runs/epm5-rg-do1-s16-16k. Trained in 1,529 s of wall time on the development CPU, 2026-11-25.
#
# Figures: docs/results.md, "Shipped trained checkpoints".
#
# Run from the repository root: recipes/even_pair_mod5-regulargpt.sh [more train flags, which override the recipe's].
# OUT=folder (default runs/even_pair_mod5-regulargpt; a folder holding a checkpoint is refused), PYTHON=interpreter.
# Evaluate: recipes/evaluate.sh runs/even_pair_mod5-regulargpt
set -eu
OUT=${OUT:-runs/even_pair_mod5-regulargpt}
exec "${PYTHON:-python}" -m training train \
    --task even_pair_mod5 --arch regulargpt --out-of-range null --chunk-size 2 --d-model 64 --heads 4 --d-ff 128 \
    --batch-size 64 --lr 2e-3 --schedule cosine --warmup-steps 100 --eval-every 250 --eval-samples 200 --seed 16 \
    --steps 16000 --p-one 0.1-0.9 --dropout 0.1 --threads 1 --save-every 500 --no-progress \
    --out "$OUT" "$@"
