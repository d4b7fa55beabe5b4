#!/usr/bin/env bash
# The IsoFLOP pipeline at micro scale on the embedded demo corpus, all four families, on 2 CPU
# cores (budgeted under an hour): plan -> train (each run ends with its validation NELBO) -> fit
# -> plot. 2 budgets x 3 CPU presets x 4 families = 24 runs of 64-token sequences.
#
#   bash examples/isoflop_demo_cpu.sh            # writes runs/isoflop-demo/{manifest.json,runs/,fits/}
#
# Micro budgets train far fewer tokens per parameter than the paper's sweep, so the curves show
# the pipeline working, not the paper's optima (a budget whose losses have no minimum over the
# sizes is listed as skipped in fits/results.md). The speed-quality frontier needs Gen PPL and
# throughput files from tools/evaluate.py: pass them to tools/scaling_laws.py with --gen-ppl and
# --throughput.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/isoflop-demo}
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
mkdir -p "$OUT"

# vocab 4097: the demo tokenizer's 4096 pieces + [MASK]; iterations = floor(budget / FLOPs per iteration)
python tools/plan_isoflop.py --budgets 1e12 3e12 --presets cpu-tiny cpu-small cpu-base \
    --seq-length 64 --global-batch-size 16 --vocab-size 4097 --nproc-per-node 2 \
    --runs-dir "$OUT/runs" --manifest "$OUT/manifest.json" --format commands \
    --extra-args "--micro-batch-size 8 --eval-iters 4 --log-interval 100" > "$OUT/commands.sh"
python tools/plan_isoflop.py --budgets 1e12 3e12 --presets cpu-tiny cpu-small cpu-base \
    --seq-length 64 --global-batch-size 16 --vocab-size 4097

while read -r command; do
    echo "+ $command"
    bash -c "$command" > /dev/null
done < "$OUT/commands.sh"

python tools/scaling_laws.py --manifest "$OUT/manifest.json" --out-dir "$OUT/fits"
echo "figures and tables in $OUT/fits"
