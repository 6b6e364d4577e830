#!/bin/sh
# Recipe of checkpoints/a5_generators-regulargpt: RegularGPT d128, d_ff 2,048, C = 2, 4 heads, post-norm blocks, null
# keys, lengths 1-40 (a growing curriculum from 4 over the first 30% of 5,000 steps); then level codes (python -m
# training snap), made from and checked on strings of 40 symbols.
#
# The commands recorded in checkpoints/a5_generators-regulargpt/config.json (metadata.command, and
# metadata.level_codes.command), but for --out and the run's --time-budget 3600 and --resume (one thread, 3,600 s,
# then 850 s).
#
# Figures: docs/results.md, "S5 and A5 word problems".
#
# Run from the repository root: recipes/a5_generators-regulargpt.sh [more train flags, which override the recipe's].
# OUT=folder (default runs/a5_generators-regulargpt; the trained model is written to $OUT-trained first; a folder
# holding a checkpoint is refused), PYTHON=interpreter.
# Evaluate: python -m training eval --checkpoint runs/a5_generators-regulargpt --bands 41-500,501-2000,2001-5000
set -eu
OUT=${OUT:-runs/a5_generators-regulargpt}
"${PYTHON:-python}" -m training train \
    --task a5_generators --arch regulargpt --out-of-range null --block-norm post --chunk-size 2 --d-model 128 \
    --heads 4 --d-ff 2048 --curriculum growing --curriculum-start 4 --curriculum-fraction 0.3 --batch-size 64 \
    --lr 1e-3 --schedule cosine --warmup-steps 200 --steps 5000 --eval-every 500 --eval-samples 200 --seed 0 \
    --threads 1 --no-progress --log-every 50 \
    --out "$OUT-trained" "$@"
exec "${PYTHON:-python}" -m training snap --checkpoint "$OUT-trained" --out "$OUT" --threads 1
