#!/bin/sh
# Recipe of checkpoints/cycle_navigation-lrnn: LRNN, spectral norm, one layer of 8 blocks of 2, P(1) drawn from
# [0.1, 0.9] per string.
#
# Then state codes (python -m training snap, 2026-12-05): each block's state snapped after every 8th symbol to the
# nearest state it visits at the training lengths, which keeps it right far past them (docs/models.md).
#
# The commands recorded in checkpoints/cycle_navigation-lrnn/config.json (metadata.command and
# metadata.state_codes.command), but for --out /tmp/gruns/cpu-cn-lrnn-s2, --overwrite. Trained in 336 s of wall time
# on one Xeon core of the lent GPU machine (torch 2.11, --device cpu), 2026-11-23.
#
# It was trained by the training loop of its day, before the one trainer of 2026-11-23: the flags mean the same
# today (where the weight decay is not 0, it now skips norms and biases), but the weights a run gives now need not
# be bitwise the shipped ones.
#
# Figures: docs/results.md, "Shipped trained checkpoints".
#
# Run from the repository root: recipes/cycle_navigation-lrnn.sh [more train flags, which override the recipe's].
# OUT=folder (default runs/cycle_navigation-lrnn; the trained model is written to $OUT-trained first; a folder holding a
# checkpoint is refused), PYTHON=interpreter.
# Evaluate: recipes/evaluate.sh runs/cycle_navigation-lrnn
set -eu
OUT=${OUT:-runs/cycle_navigation-lrnn}
"${PYTHON:-python}" -m training train \
    --task cycle_navigation --arch lrnn --transition-norm spectral --p-norm 2 --block-size 2 --num-blocks 8 \
    --d-model 32 --d-ff 64 --batch-size 128 --lr 3e-3 --schedule cosine --optimizer adamw --weight-decay 0 \
    --eval-every 250 --eval-samples 200 --layers 1 --seed 2 --steps 6000 --p-one 0.1-0.9 --device cpu \
    --no-progress \
    --out "$OUT-trained" "$@"
exec "${PYTHON:-python}" -m training snap --checkpoint "$OUT-trained" --out "$OUT" --threads 1
