#!/usr/bin/env bash
# The paper's 1.7B model (preset 1708M: h 2176, 28 layers, 17 heads) on one node of 8 H100s.
# The recipe lives in pretrain_1.7b.yaml: bf16 + TransformerEngine FP8 (hybrid, delayed scaling),
# data parallel with the distributed optimizer (17 heads admit no TP), global batch 1024 x 2048
# tokens, warmup 2000 (the paper's 1.7B scripts fix it), weight decay on every
# parameter as the paper's code, WSD decay over the last third, 2.1T tokens = 1,001,358 iterations; async
# saves with retention, SIGTERM/SIGUSR1 handling and the non-finite guard.
# Optional: WANDB_PROJECT=... (pip install -e ".[wandb]"), PROFILE=1 (torch profiler, steps 100-102).
set -euo pipefail
DATA=${DATA:?set DATA to a Megatron .bin/.idx prefix (or a blend "w1 p1 w2 p2")}
TOKENIZER=${TOKENIZER:?set TOKENIZER to the tokenizer.json the data was preprocessed with}
FAMILY=${FAMILY:-mdlm}
SAVE=${SAVE:-./checkpoints/1.7b-$FAMILY}
EXTRA=()
[ -n "${WANDB_PROJECT:-}" ] && EXTRA+=(--wandb-project "$WANDB_PROJECT" --wandb-exp-name "1.7b-$FAMILY")
[ -n "${PROFILE:-}" ] && EXTRA+=(--profile --profile-step-start 100 --profile-step-end 102 --profile-ranks 0)

torchrun --nproc-per-node 8 pretrain_dllm.py --yaml-cfg "$(dirname "$0")/pretrain_1.7b.yaml" \
  --family "$FAMILY" --data-path $DATA --data-cache-path "${CACHE:-./index-cache}" \
  --tokenizer-model "$TOKENIZER" --save "$SAVE" --load "$SAVE" \
  --tensorboard-dir "${TB:-./tensorboard/1.7b-$FAMILY}" "${EXTRA[@]}"
