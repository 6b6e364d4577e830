#!/bin/sh
# Recipe of checkpoints/modular_arithmetic-lrnn: LRNN with spectral-norm transitions (column p = 2), 3 layers of 8
# blocks of 2, d32, d_ff 64, lengths 1-40 (the protocol's recipe of docs/results.md, seed 0); then state codes
# (python -m training snap): each block's state snapped to the nearest state it visits at lengths 1-40, after every
# 8th symbol.
#
# The commands recorded in checkpoints/modular_arithmetic-lrnn/config.json (metadata.command, and
# metadata.state_codes.command), but for --out.
#
# Figures: docs/results.md, "modular_arithmetic".
#
# Run from the repository root: recipes/modular_arithmetic-lrnn.sh [more train flags, which override the recipe's].
# OUT=folder (default runs/modular_arithmetic-lrnn; the trained model is written to $OUT-trained first; a folder
# holding a checkpoint is refused), PYTHON=interpreter.
# Evaluate: recipes/evaluate.sh runs/modular_arithmetic-lrnn
set -eu
OUT=${OUT:-runs/modular_arithmetic-lrnn}
"${PYTHON:-python}" -m training train \
    --task modular_arithmetic --arch lrnn --transition-norm spectral --p-norm 2 --block-size 2 --d-model 32 \
    --d-ff 64 --batch-size 128 --lr 3e-3 --schedule cosine --optimizer adamw --weight-decay 0 --eval-every 500 \
    --eval-samples 200 --layers 3 --num-blocks 8 --steps 6000 --seed 0 --threads 1 --no-progress \
    --out "$OUT-trained" "$@"
exec "${PYTHON:-python}" -m training snap --checkpoint "$OUT-trained" --out "$OUT" --threads 1
