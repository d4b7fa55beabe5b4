#!/usr/bin/env bash
# The CPU fine-tuning demonstration (docs/sft.md): pretrain on the Shakespeare demo corpus, score a
# synthetic arithmetic task (held-out problems), fine-tune with --sft, score again. Not GSM8K: the
# task only exercises the same commands (its test split is in GSM8K's JSONL format).
#   bash examples/sft_arithmetic_cpu.sh [families...]     (default: ar mdlm; NPROC ranks, default 2)
set -euo pipefail
OUT=${OUT:-runs/sft-demo}
DEMO=${DEMO_CACHE:-$HOME/.cache/megatron_dllm/demo}
TOK=(--tokenizer-type SentencePieceTokenizer --tokenizer-model "$DEMO/shakespeare_bpe4096.model")
EPOCHS=${EPOCHS:-40}
LIMIT=${LIMIT:-100}
NPROC=${NPROC:-2}
LR=${LR:-2e-3}
MIN_LR=${MIN_LR:-1e-4}
families=("$@")
[ ${#families[@]} -gt 0 ] || families=(ar mdlm)
mkdir -p "$OUT"
stamp() { date +%s; }
# the task and its SFT dataset, shared by the families: one invocation prepares them (several may run at once)
exec {task_lock}>"$OUT/task.lock"
flock "$task_lock"
[ -f "$OUT/task/test.jsonl" ] || python -m megatron_dllm.data.prep.arithmetic "$OUT/task"   # 900 train / 100 test, column steps
[ -f "$OUT/task/train_sft.idx" ] || python tools/preprocess_sft_data.py --input "$OUT/task/train.txt" \
  --output-prefix "$OUT/task/train_sft" --seq-length 48 "${TOK[@]}"
flock -u "$task_lock"
scored_with_limit() {  # a GSM8K result file of this --limit
  python -c 'import json, sys; sys.exit(json.load(open(sys.argv[1]))["settings"]["limit"] != int(sys.argv[2]))' "$1" "$LIMIT" \
    2>/dev/null
}
for family in "${families[@]}"; do
  run="$OUT/$family"
  t0=$(stamp)
  fresh=0  # whether this invocation runs every stage, whose times wall_time.json records
  [ -f "$run/pretrained/latest_checkpointed_iteration.txt" ] || { fresh=1;
    torchrun --nproc-per-node "$NPROC" pretrain_dllm.py --family "$family" --demo-cache-dir "$DEMO" \
      --save "$run/pretrained" --tensorboard-dir "$run/tb-pretrain"; }
  t1=$(stamp)
  scored_with_limit "$run/before.json" || python tools/evaluate.py gsm8k --load "$run/pretrained" \
    --data "$OUT/task/test.jsonl" --limit "$LIMIT" --max-new-tokens 32 --output "$run/before.json" \
    --predictions "$run/before.jsonl" --overwrite
  t2=$(stamp)
  torchrun --nproc-per-node "$NPROC" pretrain_dllm.py --sft --family "$family" --pretrained-checkpoint "$run/pretrained" \
    --data-path "$OUT/task/train_sft" --split 98,2,0 "${TOK[@]}" --preset cpu-small --seq-length 48 \
    --micro-batch-size 16 --global-batch-size 32 --train-epochs "$EPOCHS" --lr "$LR" --min-lr "$MIN_LR" \
    --lr-warmup-fraction 0.01 --eval-interval 50 --eval-iters 1 --log-interval 25 \
    --load "$run/sft" --save "$run/sft" --tensorboard-dir "$run/tb-sft" --metrics-file "$run/sft-metrics.jsonl"
  t3=$(stamp)
  python tools/evaluate.py gsm8k --load "$run/sft" --data "$OUT/task/test.jsonl" --limit "$LIMIT" \
    --max-new-tokens 32 --output "$run/after.json" --predictions "$run/after.jsonl" --overwrite
  t4=$(stamp)
  if [ "$fresh" = 1 ]; then
    echo "{\"family\": \"$family\", \"pretrain_s\": $((t1 - t0)), \"score_before_s\": $((t2 - t1)), " \
         "\"sft_s\": $((t3 - t2)), \"score_after_s\": $((t4 - t3))}" > "$run/wall_time.json"
  fi
done
