#!/bin/sh
# Recipe of checkpoints/sum_mod5-regulargpt: RegularGPT d64, C = 2.
#
# The commands recorded in checkpoints/sum_mod5-regulargpt/config.json (metadata.command; metadata.level_codes.command,
# 2026-12-05: level codes, docs/models.md), but for --out
# runs/sum_mod5-regulargpt-d64, --overwrite. Trained in 814 s of wall time on the development CPU, 2026-11-22/23.
#
# It was trained by the training loop of its day, before the one trainer of 2026-11-23: the flags mean the same
# today (where the weight decay is not 0, it now skips norms and biases), but the weights a run gives now need not
# be bitwise the shipped ones.
#
# Figures: docs/results.md, "Shipped trained checkpoints".
#
# Run from the repository root: recipes/sum_mod5-regulargpt.sh [more train flags, which override the recipe's].
# OUT=folder (default runs/sum_mod5-regulargpt; the trained model is written to $OUT-trained first, then given level
# codes by python -m training snap; a folder holding a checkpoint is refused), PYTHON=interpreter.
# Evaluate: recipes/evaluate.sh runs/sum_mod5-regulargpt
set -eu
OUT=${OUT:-runs/sum_mod5-regulargpt}
"${PYTHON:-python}" -m training train \
    --task sum_mod5 --arch regulargpt --out-of-range null --chunk-size 2 --d-model 64 --heads 4 --d-ff 128 \
    --batch-size 64 --lr 2e-3 --schedule cosine --warmup-steps 100 --eval-every 250 --eval-samples 200 \
    --steps 4000 --seed 0 --no-progress \
    --out "$OUT-trained" "$@"
exec "${PYTHON:-python}" -m training snap --checkpoint "$OUT-trained" --out "$OUT" --threads 1
