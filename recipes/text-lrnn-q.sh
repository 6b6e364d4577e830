#!/bin/sh
# Recipe of Q (recipes/stages/text-lrnn-q): the text-lrnn shipped from 2026-11-26 22:50 to 2026-11-30, now the
# teacher of the shipped text-lrnn's last two stages (recipes/text-lrnn.sh, `--teacher`; the shipped checkpoint's
# config.json names it checkpoints/text-lrnn, where Q was when they ran). A language model that keeps a pass key
# (docs/api.md, Long-context probes). LRNN with stochastic transitions (every block's state a distribution: it holds a symbol exactly
# and cannot overflow), 2 layers of 16 blocks of 8, d_model 128, d_ff 512, on the Austen corpus with the shipped 8k
# BPE, in ten stages, each started from the last one's weights (--init-from):
#
#   1. pass-key rows only (--passkey-fraction 1.0), 4,000 steps, lr 3e-3 cosine, softmax columns for the first 2,000
#      (the default --soft-transition-steps), then sparsemax: the key is learned from step ~2,500 (runs/pk/G);
#   2. text mixed in gradually: the pass-key share falls linearly from 1.0 to 0.2 over 4,500 steps, lr 1e-3, up to 2
#      distractor numbers in each example's filler (runs/pk/H; half the rows as text at once lost the key);
#   3. a fifth of the rows pass-key examples, 2,000 steps at lr 5e-4 (runs/pk/H2): perplexity 115 on 128-token
#      windows, but rising with context (92 -> 121 from 128 to 8,192 tokens: it never saw a state older than 128);
#   4. the same with --state-passing, 1,000 steps at lr 3e-4 (runs/pk/H3): flat with context;
#   5. windows of 512 tokens (batch 8), state passing, 1,500 steps at lr 3e-4 (runs/pk/J): text rewards memory;
#   6. the same with two fifths of the rows pass-key examples, 1,000 steps (runs/pk/J2);
#   7. back to windows of 128 (batch 16), two fifths pass-key rows, state passing, 1,000 steps at lr 3e-4 (runs/pk/J3):
#      the better text of 5-6 and more of the key than 4;
#   8. half the rows pass-key examples, 2,500 steps at lr 3e-4 (runs/pk/K, shipped 12:30-22:50): more of the key
#      (40 of 50 probe prompts to 64k tokens against 35), a little less of the text;
#   9. windows of 2,048 tokens with the whole gradient through them (batch 16), half the rows pass-key prompts,
#      state passing, lr 3e-4 constant, 1,000 steps, on a GPU (runs/gpuM: an H100 run of 6,992 steps whose best
#      validation came at step 1,000): the first stage whose model predicts better with more context;
#      (The shipped run went on to step 6,992 under --time-budget 407, and a language model's checkpoint holds its
#      last weights, so stage 10 most likely started from step 6,992's; its folder is not kept to check.)
#  10. windows of 512 (batch 8), the same mix, 1,000 steps at lr 3e-4 cosine (runs/pk/Q: Q's weights, its
#      last step's; its best validation came at step 500): perplexity falls from 84 at 128 tokens of context to 75
#      at 2,048 and 8,192.
#
# Trained on one thread of the development CPU beside other jobs, 2026-11-26: 1,410 s + 2,912 s + 1,480 s + 862 s +
# 2,984 s + 1,718 s + 755 s + 2,027 s, then 407 s on an H100 (stage 9; 63 s to step 1,000) and 1,190 s on the
# CPU. The commands recorded in each run's config.json (metadata.command) are these, with --out runs/pk/G, H, H2,
# H3, J, J2, J3, K, /tmp/M (stage 9: --time-budget 407 --steps 100000 --eval-every 200), runs/pk/Q;
# recipes/stages/text-lrnn-q/train.jsonl is stage 10's log.
#
# Needs the `text` extra and the corpus (apt-get install r-cran-janeaustenr).
# Figures: docs/text_results.md, "Shipped text models" and "Training for the pass key: where it stands"; every
# stage's own: docs/log/text-results-2026-11.md, "Training for the pass key, stage by stage".
#
# Run from the repository root: recipes/text-lrnn-q.sh [more train flags for every stage].
# OUT=folder prefix (default runs/text-lrnn: stages in runs/text-lrnn-1 .. -9 and runs/text-lrnn), PYTHON=interpreter,
# DEVICE=where stage 9 runs (default auto: a GPU if there is one; about an hour and a half on one CPU thread instead).
# Evaluate: EVAL_FLAGS="--train-length 128" recipes/evaluate-text.sh runs/text-lrnn, and
#   python -m training text-eval --checkpoint runs/text-lrnn --probe passkey --sizes 1k,8k,64k --filler austen,grass
set -eu
OUT=${OUT:-runs/text-lrnn}
PYTHON=${PYTHON:-python}
DEVICE=${DEVICE:-auto}
MODEL="--arch lrnn --transition-norm stochastic --layers 2 --block-size 8 --num-blocks 16 --d-model 128 --d-ff 512 \
    --tokenizer checkpoints/text-lrnn/tokenizer.tiktoken --corpus austen --length 128 --batch-size 16 \
    --eval-every 250 --log-every 10 --threads 1 --no-progress"
# shellcheck disable=SC2086
"$PYTHON" -m training text-train $MODEL --lr 3e-3 --steps 4000 --harden-steps 0 --passkey-fraction 1.0 \
    --passkey-distractors 0 --out "$OUT-1" "$@"
# shellcheck disable=SC2086
"$PYTHON" -m training text-train $MODEL --lr 1e-3 --warmup-steps 100 --soft-transition-steps 0 --steps 4500 \
    --passkey-fraction 1.0 --passkey-fraction-final 0.2 --passkey-distractors 2 --init-from "$OUT-1" \
    --out "$OUT-2" "$@"
# shellcheck disable=SC2086
"$PYTHON" -m training text-train $MODEL --lr 5e-4 --warmup-steps 50 --soft-transition-steps 0 --steps 2000 \
    --passkey-fraction 0.2 --passkey-distractors 2 --init-from "$OUT-2" \
    --out "$OUT-3" "$@"
# shellcheck disable=SC2086
"$PYTHON" -m training text-train $MODEL --lr 3e-4 --warmup-steps 50 --soft-transition-steps 0 --steps 1000 \
    --passkey-fraction 0.2 --passkey-distractors 2 --state-passing --init-from "$OUT-3" \
    --out "$OUT-4" "$@"
# shellcheck disable=SC2086
"$PYTHON" -m training text-train $MODEL --length 512 --batch-size 8 --lr 3e-4 --warmup-steps 50 \
    --soft-transition-steps 0 --steps 1500 --passkey-fraction 0.2 --passkey-distractors 2 --state-passing \
    --init-from "$OUT-4" --out "$OUT-5" "$@"
# shellcheck disable=SC2086
"$PYTHON" -m training text-train $MODEL --length 512 --batch-size 8 --lr 3e-4 --warmup-steps 50 \
    --soft-transition-steps 0 --steps 1000 --passkey-fraction 0.4 --passkey-distractors 2 --state-passing \
    --init-from "$OUT-5" --out "$OUT-6" "$@"
# shellcheck disable=SC2086
"$PYTHON" -m training text-train $MODEL --lr 3e-4 --warmup-steps 50 --soft-transition-steps 0 --steps 1000 \
    --passkey-fraction 0.4 --passkey-distractors 2 --state-passing --init-from "$OUT-6" \
    --out "$OUT-7" "$@"
# shellcheck disable=SC2086
"$PYTHON" -m training text-train $MODEL --lr 3e-4 --warmup-steps 50 --soft-transition-steps 0 --steps 2500 \
    --passkey-fraction 0.5 --passkey-distractors 2 --state-passing --init-from "$OUT-7" \
    --out "$OUT-8" "$@"
# shellcheck disable=SC2086
"$PYTHON" -m training text-train $MODEL --length 2048 --batch-size 16 --lr 3e-4 --schedule constant \
    --warmup-steps 50 --soft-transition-steps 0 --steps 1000 --eval-every 200 --passkey-fraction 0.5 \
    --passkey-distractors 2 --state-passing --device "$DEVICE" --dtype float32 --init-from "$OUT-8" \
    --out "$OUT-9" "$@"
# shellcheck disable=SC2086
exec "$PYTHON" -m training text-train $MODEL --length 512 --batch-size 8 --lr 3e-4 --warmup-steps 50 \
    --soft-transition-steps 0 --steps 1000 --passkey-fraction 0.5 --passkey-distractors 2 --state-passing \
    --init-from "$OUT-9" --out "$OUT" "$@"
