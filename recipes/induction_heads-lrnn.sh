#!/bin/sh
# Recipe of checkpoints/induction_heads-lrnn: stochastic LRNN (softmax columns for the first 600 steps, then the
# sparsemax), two layers of 8 blocks of 8, d_model 64, with a length curriculum: the longest training string grows
# from 16 to 256 symbols over the soft phase, then lengths stay uniform over 3-256 (trained at one fixed length
# 256 instead, the same model learned nothing, in the team lead's probe).
#
# The command recorded in checkpoints/induction_heads-lrnn/config.json (metadata.command), but for --out
# runs/ih-lrnn-a, --time-budget 2400 (it finished inside it) and --harden-steps 0 (the switch at once these weights
# had; the default now blends). Trained in 1,770 s of wall time on the development CPU beside other jobs,
# 2026-11-25 night.
#
# Figures: docs/results.md, "Induction heads".
#
# Run from the repository root: recipes/induction_heads-lrnn.sh [more train flags, which override the recipe's].
# OUT=folder (default runs/induction_heads-lrnn; a folder holding a checkpoint is refused), PYTHON=interpreter.
# Evaluate: python -m training eval --checkpoint runs/induction_heads-lrnn --protocol induction --chunk-symbols 65536
set -eu
OUT=${OUT:-runs/induction_heads-lrnn}
exec "${PYTHON:-python}" -m training train \
    --task induction_heads --arch lrnn --transition-norm stochastic --layers 2 --d-model 64 --d-ff 128 \
    --curriculum growing --curriculum-start 16 --curriculum-fraction 0.5 --batch-size 32 --lr 3e-3 \
    --optimizer adamw --weight-decay 0 --schedule cosine --steps 1200 --harden-steps 0 --eval-every 100 \
    --eval-lengths 257-1024 --eval-samples 50 --seed 0 --threads 1 --no-progress --log-every 20 \
    --out "$OUT" "$@"
