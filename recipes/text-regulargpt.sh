#!/bin/sh
# Recipe of checkpoints/text-regulargpt: language model, RegularGPT C = 64, K = 4, d_model 128, on the Austen
# corpus.
#
# The command recorded in checkpoints/text-regulargpt/config.json (metadata.command), but for --time-budget 2100,
# --out runs/text/regulargpt-one-trainer. Trained in 1,807 s of wall time on the development CPU (shared, load 5-8),
# 2026-11-23.
#
# Needs the `text` extra and the corpus (apt-get install r-cran-janeaustenr); the tokenizer is the shipped one, made
# by: python -m training bpe --corpus austen --ranks 8191 --out runs/text/austen-8k.tiktoken.
#
# Figures: docs/text_results.md, "Shipped text models".
#
# Run from the repository root: recipes/text-regulargpt.sh [more train flags, which override the recipe's].
# OUT=folder (default runs/text-regulargpt; a folder holding a checkpoint is refused), PYTHON=interpreter.
# Evaluate: recipes/evaluate-text.sh runs/text-regulargpt
set -eu
OUT=${OUT:-runs/text-regulargpt}
exec "${PYTHON:-python}" -m training text-train \
    --arch regulargpt --chunk-size 64 --thickness 4 --heads 4 --attention-impl auto \
    --tokenizer checkpoints/text-regulargpt/tokenizer.tiktoken --corpus austen --length 128 --batch-size 16 \
    --lr 1e-3 --warmup-steps 100 --steps 714 --eval-every 100 --log-every 10 --threads 1 --d-model 128 \
    --d-ff 512 --no-progress \
    --out "$OUT" "$@"
