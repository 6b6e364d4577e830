#!/bin/sh
# Recipe of checkpoints/parity_check-regulargpt: RegularGPT d32, C = 2; --target-accuracy 1.0 stops it at the first
# perfect evaluation (step 500).
#
# The commands recorded in checkpoints/parity_check-regulargpt/config.json (metadata.command; metadata.level_codes.command,
# 2026-12-05: level codes, docs/models.md), but for --out
# runs/parity_check-regulargpt. Trained in 67 s of wall time on the development CPU, 2026-11-22/23.
#
# It was trained by the training loop of its day, before the one trainer of 2026-11-23: the flags mean the same
# today (where the weight decay is not 0, it now skips norms and biases), but the weights a run gives now need not
# be bitwise the shipped ones.
#
# Figures: docs/results.md, "Shipped trained checkpoints".
#
# Run from the repository root: recipes/parity_check-regulargpt.sh [more train flags, which override the recipe's].
# OUT=folder (default runs/parity_check-regulargpt; the trained model is written to $OUT-trained first, then given level
# codes by python -m training snap; a folder holding a checkpoint is refused), PYTHON=interpreter.
# Evaluate: recipes/evaluate.sh runs/parity_check-regulargpt
set -eu
OUT=${OUT:-runs/parity_check-regulargpt}
"${PYTHON:-python}" -m training train \
    --task parity_check --arch regulargpt --out-of-range null --chunk-size 2 --d-model 32 --heads 2 --d-ff 64 \
    --steps 2000 --batch-size 64 --lr 2e-3 --schedule cosine --warmup-steps 100 --p-one 0-1 --eval-every 250 \
    --eval-samples 100 --target-accuracy 1.0 --seed 0 --no-progress \
    --out "$OUT-trained" "$@"
exec "${PYTHON:-python}" -m training snap --checkpoint "$OUT-trained" --out "$OUT" --threads 1
