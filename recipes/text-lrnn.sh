#!/bin/sh
# Recipe of checkpoints/text-lrnn: language model, LRNN of 2 layers of 16 blocks of 8, d_model 128, on the Austen
# corpus.
#
# The command recorded in checkpoints/text-lrnn/config.json (metadata.command), but for --out
# runs/text/lrnn-one-trainer. Trained in 1,316 s of wall time on the development CPU (shared, load 6-8), 2026-11-23.
#
# Needs the `text` extra and the corpus (apt-get install r-cran-janeaustenr); the tokenizer is the shipped one, made
# by: python -m training bpe --corpus austen --ranks 8191 --out runs/text/austen-8k.tiktoken.
#
# Figures: docs/text_results.md, "Shipped text models".
#
# Run from the repository root: recipes/text-lrnn.sh [more train flags, which override the recipe's].
# OUT=folder (default runs/text-lrnn; a folder holding a checkpoint is refused), PYTHON=interpreter.
# Evaluate: recipes/evaluate-text.sh runs/text-lrnn
set -eu
OUT=${OUT:-runs/text-lrnn}
exec "${PYTHON:-python}" -m training text-train \
    --arch lrnn --layers 2 --block-size 8 --num-blocks 16 --tokenizer checkpoints/text-lrnn/tokenizer.tiktoken \
    --corpus austen --length 128 --batch-size 16 --lr 1e-3 --warmup-steps 100 --steps 602 --eval-every 100 \
    --log-every 10 --threads 1 --d-model 128 --d-ff 512 --no-progress \
    --out "$OUT" "$@"
