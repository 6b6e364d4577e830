#!/bin/sh
# Recipe of checkpoints/even_pairs-regulargpt: RegularGPT d32, C = 2, dropout 0.1, 8,000 steps, seed 2.
#
# The command recorded in checkpoints/even_pairs-regulargpt/config.json (metadata.command), but for --out
# runs/ep-rg-do1-8k-s2. Trained in 376 s of wall time on the development CPU, 2026-11-25.
#
# Figures: docs/results.md, "Shipped trained checkpoints".
#
# Run from the repository root: recipes/even_pairs-regulargpt.sh [more train flags, which override the recipe's].
# OUT=folder (default runs/even_pairs-regulargpt; a folder holding a checkpoint is refused), PYTHON=interpreter.
# Evaluate: recipes/evaluate.sh runs/even_pairs-regulargpt
set -eu
OUT=${OUT:-runs/even_pairs-regulargpt}
exec "${PYTHON:-python}" -m training train \
    --task even_pairs --arch regulargpt --out-of-range null --chunk-size 2 --d-model 32 --heads 2 --d-ff 64 \
    --steps 8000 --batch-size 64 --lr 2e-3 --schedule cosine --warmup-steps 100 --p-one 0-1 --eval-every 250 \
    --eval-samples 100 --threads 1 --save-every 500 --seed 2 --dropout 0.1 --no-progress \
    --out "$OUT" "$@"
