#!/usr/bin/env bash
# The paper's 1.7B model (preset 1708M: h 2176, 28 layers, 17 heads) on one node of 8 H100s.
# 17 heads admit no tensor parallelism (TP must divide the heads), so the model is data parallel
# with the distributed optimizer; bf16 with TransformerEngine FP8 (hybrid, delayed scaling).
# Recipe: global batch 1024 x 2048 tokens, warmup 2000 iterations, constant LR, decay over the
# last third (WSD). 2.1T tokens = 1,001,358 iterations of 1024 x 2048. Weight decay on every
# parameter (--apply-wd-to-all-params), as the paper's code; its 1.7B scripts fix the warmup at 2000.
set -euo pipefail
DATA=${DATA:?set DATA to a Megatron .bin/.idx prefix (or a blend "w1 p1 w2 p2")}
TOKENIZER=${TOKENIZER:?set TOKENIZER to the tokenizer.json the data was preprocessed with}
FAMILY=${FAMILY:-mdlm}

torchrun --nproc-per-node 8 pretrain_dllm.py \
  --family "$FAMILY" --preset 1.7B --seq-length 2048 \
  --micro-batch-size 4 --global-batch-size 1024 --train-iters 1001358 \
  --lr 3e-4 --min-lr 4e-5 --lr-warmup-iters 2000 --lr-decay-style WSD \
  --lr-wsd-decay-style cosine --lr-wsd-decay-iters 333786 \
  --weight-decay 0.1 --apply-wd-to-all-params --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 \
  --use-distributed-optimizer --overlap-grad-reduce \
  --bf16 --transformer-impl transformer_engine \
  --fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max \
  --data-path $DATA --split 998,2,0 --data-cache-path "${CACHE:-./index-cache}" \
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER" \
  --log-interval 10 --eval-interval 2000 --eval-iters 100 \
  --save "${SAVE:-./checkpoints/1.7b-$FAMILY}" --load "${SAVE:-./checkpoints/1.7b-$FAMILY}" \
  --save-interval 1000 --tensorboard-dir "${TB:-./tensorboard/1.7b-$FAMILY}"
