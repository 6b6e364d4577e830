#!/bin/sh
# Recipe of checkpoints/s5_generators-lrnn: LRNN with orthogonal transitions (each block's polar factor, no input
# term, a learned initial point), one layer of 16 blocks of 5, d64, lengths 1-40 with a growing curriculum from 4.
#
# Then state codes (python -m training snap, 2026-12-05): each block's state snapped after every 8th symbol to the
# nearest state it visits at the training lengths, which keeps it right far past them (docs/models.md).
#
# The commands recorded in checkpoints/s5_generators-lrnn/config.json (metadata.command and
# metadata.state_codes.command), but for --out.
#
# Figures: docs/results.md, "S5 and A5 word problems".
#
# Run from the repository root: recipes/s5_generators-lrnn.sh [more train flags, which override the recipe's].
# OUT=folder (default runs/s5_generators-lrnn; the trained model is written to $OUT-trained first; a folder holding a
# checkpoint is refused), PYTHON=interpreter.
# Evaluate: python -m training eval --checkpoint runs/s5_generators-lrnn --bands 41-500,501-2000,2001-5000
set -eu
OUT=${OUT:-runs/s5_generators-lrnn}
"${PYTHON:-python}" -m training train \
    --task s5_generators --arch lrnn --transition-norm orthogonal --block-size 5 --num-blocks 16 --d-model 64 \
    --d-ff 128 --layers 1 --batch-size 128 --lr 3e-3 --schedule cosine --optimizer adamw --weight-decay 0 \
    --eval-every 250 --eval-samples 200 --seed 1 --steps 4000 --time-budget 2700 --curriculum growing \
    --curriculum-start 4 --curriculum-fraction 0.5 --device cpu --threads 1 --no-progress \
    --out "$OUT-trained" "$@"
exec "${PYTHON:-python}" -m training snap --checkpoint "$OUT-trained" --out "$OUT" --threads 1
