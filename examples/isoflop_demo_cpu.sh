#!/usr/bin/env bash
# The paper's whole scaling pipeline at micro scale, all four families, on the embedded demo corpus
# and 2 CPU cores in about 46 minutes:
#   plan (tools/plan_isoflop.py) -> train every budget x family x size for exactly its FLOPs
#   (each run ends with its validation NELBO) -> sample each family at several step counts, judge
#   the samples with SmolLM2-135M (Gen PPL) and time them (throughput) -> fit the IsoFLOP
#   parabolas, power laws, step curves and the Pareto frontier, and plot (tools/scaling_laws.py).
#
#   bash examples/isoflop_demo_cpu.sh     # runs/isoflop-demo/{plan.txt,manifest.json,runs/,eval/,fits/}
#                                         # and a copy of the figures and tables in docs/isoflop-demo/
#
# Runs are single-process (--nproc-per-node 1), JOBS (default 2) at a time: at these sizes two
# independent runs use 2 cores better than one 2-rank run. A run that has finished (its metrics
# file holds the final validation) is not run again, so an interrupted demo continues where it
# stopped. docs/isoflop-demo/README.md discusses the figures against the paper.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/isoflop-demo}
DOCS=${DOCS:-docs/isoflop-demo}
JOBS=${JOBS:-2}
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore

# The grid: 64-token sequences, 16 a batch; vocab 4097 = the demo tokenizer's 4096 pieces + [MASK].
# The largest budget takes the smallest model 1.2 times through the 1.75M-token corpus.
BUDGETS=(${BUDGETS:-5e11 1e12 2e12})
GRID=(--budgets "${BUDGETS[@]}" --presets cpu-micro cpu-mini cpu-tiny
      --seq-length 64 --global-batch-size 16 --vocab-size 4097)
TRAIN_ARGS="--micro-batch-size 16 --lr 3e-3 --eval-iters 16 --log-interval 1000"
EVAL_PRESET=cpu-mini                       # the size sampled for the speed-quality frontier,
EVAL_BUDGET=${BUDGETS[-1]}                 # from its run at the largest budget
STEPS=(${STEPS:-8 16 32 64})               # sampling steps T of the diffusion families (AR: T = L = 64)
NUM_SAMPLES=${NUM_SAMPLES:-64}
TARGETS=(${TARGETS:-250 500 1000 1500 2000 2500})  # Gen PPL targets of the frontier (the paper: 40 ... 200)

mkdir -p "$OUT" "$DOCS"

echo "== plan"
python tools/plan_isoflop.py "${GRID[@]}" --format table | tee "$OUT/plan.txt"
python tools/plan_isoflop.py "${GRID[@]}" --nproc-per-node 1 --runs-dir "$OUT/runs" \
    --manifest "$OUT/manifest.json" --format commands --extra-args "$TRAIN_ARGS" > "$OUT/commands.sh"

echo "== train ($(wc -l < "$OUT/commands.sh") runs, $JOBS at a time)"
train_one() {  # one commands.sh line; its output goes to the run directory's train.log
    local run_dir=${1#mkdir -p }; run_dir=${run_dir%% *}
    local iters; iters=$(grep -o -- '--eval-interval [0-9]*' <<< "$1" | cut -d' ' -f2)
    if python -c "import sys; from megatron_dllm.scaling.plan import final_validation as last
r = last(sys.argv[1]); sys.exit(not (r and r['iteration'] == int(sys.argv[2])))" "$run_dir/metrics.jsonl" "$iters"; then
        echo "   done before: $run_dir"; return 0
    fi
    rm -rf "$run_dir"
    local start=$SECONDS
    local code=0
    bash -c "$1" > "$run_dir.log" 2>&1 || code=$?
    if [ $code = 0 ]; then
        mv "$run_dir.log" "$run_dir/train.log"
        echo "   $(basename "$run_dir"): $(grep -o 'nelbo [0-9.]*' "$run_dir/train.log" | tail -1) ($((SECONDS - start)) s)"
    elif [ $code = 3 ]; then  # the NaN guard stopped it: a diverged run is no point of the fits, not a failure
        echo "   DIVERGED: $run_dir (see $run_dir.log; the fits list it as unfinished)"
    else
        echo "   FAILED: $run_dir (see $run_dir.log)"; return 1
    fi
}
export -f train_one
mkdir -p "$OUT/runs"
xargs -P "$JOBS" -d '\n' -n 1 bash -c 'train_one "$0"' < "$OUT/commands.sh"

echo "== sample, Gen PPL and throughput ($EVAL_PRESET at $EVAL_BUDGET)"
measured_before() {  # $1 = results directory, $2 = T, $3 = checkpoint: measured there, of NUM_SAMPLES samples
    python - "$@" "$NUM_SAMPLES" <<'EOF'
import json, os, sys
out, T, checkpoint, n = sys.argv[1:]
try:
    g, t = (json.load(open(f"{out}/{kind}_T{T}.json")) for kind in ("gen_ppl", "throughput"))
    same = (g["num_samples"] == int(n) and os.path.samefile(g["sampling"]["load"], checkpoint)
            and os.path.samefile(t["settings"]["load"], checkpoint))
except (OSError, ValueError, KeyError):
    same = False
sys.exit(0 if same else 1)
EOF
}
gen_ppl=() throughput=()  # this run's results (a T of an earlier STEPS is left out)
for family in ar mdlm duo esolm; do
    checkpoint="$OUT/runs/$family-$EVAL_PRESET-C$EVAL_BUDGET/checkpoints"
    out="$OUT/eval/$family"
    mkdir -p "$out"
    steps=("${STEPS[@]}"); [ "$family" = ar ] && steps=(64)
    predictor=ancestral; [ "$family" = esolm ] && predictor=block  # the paper's Eso-LM sampler, L' = T
    for T in "${steps[@]}"; do
        gen_ppl+=("$out/gen_ppl_T$T.json") throughput+=("$out/throughput_T$T.json")
        measured_before "$out" "$T" "$checkpoint" && continue  # done before
        python tools/sample.py --load "$checkpoint" --num-samples "$NUM_SAMPLES" --steps "$T" --seed 0 \
            --predictor $predictor --device cpu --output "$out/samples_T$T.json" --overwrite > /dev/null
        python tools/evaluate.py gen-ppl --samples "$out/samples_T$T.json" --judge smollm2 --device cpu \
            --output "$out/gen_ppl_T$T.json" --overwrite > /dev/null
        python tools/evaluate.py throughput --load "$checkpoint" --steps "$T" --batch-size 16 --repeats 3 \
            --predictor $predictor --output "$out/throughput_T$T.json" --overwrite > /dev/null
        python - "$out" "$T" <<'EOF'
import json, sys
out, T = sys.argv[1], sys.argv[2]
g = json.load(open(f"{out}/gen_ppl_T{T}.json")); t = json.load(open(f"{out}/throughput_T{T}.json"))
print(f"   {g['family']:<6} T={T:<3} Gen PPL {g['gen_ppl']:8.1f}  entropy {g['entropy']:.2f}  {t['tokens_per_s']:9.0f} tokens/s")
EOF
    done
done

echo "== fit and plot"
python tools/scaling_laws.py --manifest "$OUT/manifest.json" --gen-ppl "${gen_ppl[@]}" \
    --throughput "${throughput[@]}" --targets "${TARGETS[@]}" --out-dir "$OUT/fits"
rm -f "$DOCS"/{isoflop,loss_vs_flops,params_vs_flops,pareto}.png  # this run's only: an empty frontier draws none
cp "$OUT"/fits/*.png "$OUT/fits/results.md" "$OUT/fits/results.json" "$OUT/plan.txt" "$DOCS/"
echo "figures and tables in $OUT/fits (copied to $DOCS)"
