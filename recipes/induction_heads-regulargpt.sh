#!/bin/sh
# Recipe of checkpoints/induction_heads-regulargpt: RegularGPT d64, C = 2, 4 heads, post-norm blocks (as the authors'
# code), 4,000 steps, with the length curriculum of induction_heads-lrnn (the longest training string grows from 16
# to 256 symbols over the first half, then lengths stay uniform over 3-256). The same model with pre-norm blocks (the
# weights shipped before 2026-11-26 14:30) fell to 93-0% past 2^12 symbols; the same at 1,200 steps stayed at chance.
#
# The command recorded in checkpoints/induction_heads-regulargpt/config.json (metadata.command), but for --out
# runs/ih/rg-post-2e-3 and its repeated --lr 2e-3 and --time-budget 3600. Trained in 2,038 s of wall time on one
# thread of the development CPU beside other jobs, 2026-11-26.
#
# Figures: docs/results.md, "Induction heads".
#
# Run from the repository root: recipes/induction_heads-regulargpt.sh [more train flags, which override the recipe's].
# OUT=folder (default runs/induction_heads-regulargpt; a folder holding a checkpoint is refused), PYTHON=interpreter.
# Evaluate: python -m training eval --checkpoint runs/induction_heads-regulargpt --protocol induction --chunk-symbols 65536
set -eu
OUT=${OUT:-runs/induction_heads-regulargpt}
exec "${PYTHON:-python}" -m training train \
    --task induction_heads --arch regulargpt --out-of-range null --block-norm post --chunk-size 2 --d-model 64 \
    --heads 4 --d-ff 128 \
    --curriculum growing --curriculum-start 16 --curriculum-fraction 0.5 --batch-size 32 --lr 2e-3 \
    --schedule cosine --warmup-steps 100 --steps 4000 --eval-every 250 --eval-lengths 257-1024 --eval-samples 50 \
    --seed 0 --threads 1 --no-progress --log-every 50 \
    --out "$OUT" "$@"
