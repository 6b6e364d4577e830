#!/bin/sh
# Recipe of checkpoints/parity_check-lrnn: LRNN, column p = 1, one layer of 2 blocks of 2.
#
# Then state codes (python -m training snap, 2026-12-05): each block's state snapped after every 8th symbol to the
# nearest state it visits at the training lengths, which keeps it right far past them (docs/models.md).
#
# The commands recorded in checkpoints/parity_check-lrnn/config.json (metadata.command and
# metadata.state_codes.command), but for --out checkpoints/parity_check-lrnn. Trained in 441 s of wall time on the
# development CPU (2 cores, shared), 2026-11-22/23.
#
# It was trained by the training loop of its day, before the one trainer of 2026-11-23: the flags mean the same
# today (where the weight decay is not 0, it now skips norms and biases), but the weights a run gives now need not
# be bitwise the shipped ones.
#
# Figures: docs/results.md, "Shipped trained checkpoints".
#
# Run from the repository root: recipes/parity_check-lrnn.sh [more train flags, which override the recipe's].
# OUT=folder (default runs/parity_check-lrnn; the trained model is written to $OUT-trained first; a folder holding a
# checkpoint is refused), PYTHON=interpreter.
# Evaluate: recipes/evaluate.sh runs/parity_check-lrnn
set -eu
OUT=${OUT:-runs/parity_check-lrnn}
"${PYTHON:-python}" -m training train \
    --task parity_check --arch lrnn --block-size 2 --num-blocks 2 --d-model 32 --d-ff 64 --p-norm 1.0 --layers 1 \
    --steps 3000 --batch-size 128 --lr 3e-3 --schedule cosine --optimizer adamw --weight-decay 0.1 --p-one 0-1 \
    --eval-every 250 --eval-samples 100 --seed 0 --no-progress \
    --out "$OUT-trained" "$@"
exec "${PYTHON:-python}" -m training snap --checkpoint "$OUT-trained" --out "$OUT" --threads 1
