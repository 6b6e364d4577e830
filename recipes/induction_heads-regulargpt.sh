#!/bin/sh
# Recipe of checkpoints/induction_heads-regulargpt: RegularGPT d64, C = 2, 4 heads, thickness K = 2 (two blocks per
# thick layer, shared over depth), post-norm blocks (as the authors' code), 4,000 steps, with the length curriculum
# of induction_heads-lrnn (the longest training string grows from 16 to 256 symbols over the first half, then lengths
# stay uniform over 3-256), a tenth of the strings drawn with the mark a power of two before the end. With K = 1 (the
# weights shipped before 2026-11-28) the last position missed about half of those strings, where it reads the mark in
# one hop: one block per level cannot both take the key from its own half and learn from the other half that it ends
# in the mark. K = 2 is right on them with or without the tenth (a run without it: 100% on 600 such strings at
# step 1,250). Pre-norm blocks (shipped before 2026-11-26 14:30) fell to 93-0% past 2^12 symbols.
#
# The command recorded in checkpoints/induction_heads-regulargpt/config.json (metadata.command), but for --out
# runs/ih/rg-k2. Trained in 4,819 s of wall time on one thread of the development CPU beside other jobs, 2026-11-28.
#
# Figures: docs/results.md, "Induction heads".
#
# Run from the repository root: recipes/induction_heads-regulargpt.sh [more train flags, which override the recipe's].
# OUT=folder (default runs/induction_heads-regulargpt; a folder holding a checkpoint is refused), PYTHON=interpreter.
# Evaluate: python -m training eval --checkpoint runs/induction_heads-regulargpt --protocol induction --chunk-symbols 65536
#   and, on the strings with the mark a power of two before the end, --bands 64-64,256-256,1000-1000 --power-offsets
set -eu
OUT=${OUT:-runs/induction_heads-regulargpt}
exec "${PYTHON:-python}" -m training train \
    --task induction_heads --arch regulargpt --out-of-range null --block-norm post --chunk-size 2 --d-model 64 \
    --heads 4 --d-ff 128 --thickness 2 --power-offset-fraction 0.1 \
    --curriculum growing --curriculum-start 16 --curriculum-fraction 0.5 --batch-size 32 --lr 2e-3 \
    --schedule cosine --warmup-steps 100 --steps 4000 --eval-every 250 --eval-lengths 257-1024 --eval-samples 50 \
    --seed 0 --threads 1 --no-progress --log-every 50 \
    --out "$OUT" "$@"
