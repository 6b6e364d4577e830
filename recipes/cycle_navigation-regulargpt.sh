#!/bin/sh
# Recipe of checkpoints/cycle_navigation-regulargpt: RegularGPT d64, C = 2, 8,000 steps, seed 5.
#
# The commands recorded in checkpoints/cycle_navigation-regulargpt/config.json (metadata.command; metadata.level_codes.command,
# 2026-12-05: level codes, docs/models.md), but for --out
# /tmp/gruns/cpu-cn-rg-s5, --overwrite. Trained in 1,010 s of wall time on one Xeon core of the lent GPU machine
# (torch 2.11, --device cpu), 2026-11-23.
#
# It was trained by the training loop of its day, before the one trainer of 2026-11-23: the flags mean the same
# today (where the weight decay is not 0, it now skips norms and biases), but the weights a run gives now need not
# be bitwise the shipped ones.
#
# Figures: docs/results.md, "Shipped trained checkpoints".
#
# Run from the repository root: recipes/cycle_navigation-regulargpt.sh [more train flags, which override the recipe's].
# OUT=folder (default runs/cycle_navigation-regulargpt; the trained model is written to $OUT-trained first, then given level
# codes by python -m training snap; a folder holding a checkpoint is refused), PYTHON=interpreter.
# Evaluate: recipes/evaluate.sh runs/cycle_navigation-regulargpt
set -eu
OUT=${OUT:-runs/cycle_navigation-regulargpt}
"${PYTHON:-python}" -m training train \
    --task cycle_navigation --arch regulargpt --out-of-range null --chunk-size 2 --d-model 64 --heads 4 \
    --d-ff 128 --batch-size 64 --lr 2e-3 --schedule cosine --warmup-steps 100 --eval-every 250 \
    --eval-samples 200 --seed 5 --steps 8000 --device cpu --no-progress \
    --out "$OUT-trained" "$@"
exec "${PYTHON:-python}" -m training snap --checkpoint "$OUT-trained" --out "$OUT" --threads 1
