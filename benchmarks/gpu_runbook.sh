#!/usr/bin/env bash
# The GPU measurements still open, as stages that each fit one call to a lent H100 (at most 10
# minutes per command; each stage stops starting steps after STAGE_BUDGET seconds, default 510).
# docs/gpu.md, "A GPU session, call by call", gives the calls, what each carries and where its
# figures go in benchmarks/RESULTS.md.
#
#   benchmarks/gpu_runbook.sh STAGE          # on the GPU machine, from the repository root
#   DRY=1 benchmarks/gpu_runbook.sh STAGE    # anywhere: the same steps at cpu-micro sizes, no install
#   DRY=1 benchmarks/gpu_runbook.sh all      # every stage's dry run
#
# Stages, in priority order (minutes on one H100 are estimates until a session records them):
#   s    a session with 15 minutes of device time: its one call. Install, stage t's GPU tests less
#        the Eso-LM kernel's (no extension build) with the full-iteration CUDA graph's, the whole
#        1.7B sdpa + fusion step through the graph for every family at micro-batch 4 (and MDLM's
#        without gradient-accumulation fusion), MDLM's step without the graph beside, MDLM's graph
#        at micro-batch 8 with expandable segments, then the
#        profile breakdown of the sdpa step through the graph at micro-batch 4, two per step, with
#        its trace
#   a    install (.whl into /tmp/site), SDPA's kernel for the 1.7B heads, the loss heads (megatron-core's
#        cross entropy, the families' own eager at two chunk sizes and compiled: bench_loss_heads.py), local vs sdpa and eager
#        vs fused forward + backward of the 1.7B preset at seq 2048, then the C++/CUDA extensions
#   b    the whole 1.7B step (AdamW included) at the largest micro-batch: sdpa fused, sdpa eager,
#        local fused, megatron-core's timers at levels 1 and 0, the recomputed norms and MLP activation (or MLP)
#   b2   the profile breakdown of the 1.7B step: sdpa, local, then the optimizer step without TE
#        (megatron-core's fallback vs foreach + fused AdamW), then sdpa at the paper's 32k vocabulary
#   c    the paper's step beside ours (sdpa, sdpa+layernorm, sdpa+graph), vocabulary 32,001 (needs
#        .cache/genbench/paper)
#   c2   the same at the Nemotron vocabulary, 131,072 (sdpa+layernorm+mlp_act in place of sdpa+layernorm)
#   d    generation throughput, unconditional at the 1.7B shape, L = 2048, T 16 and 64, every family
#        beside the paper's samplers (benchmarks/bench_gpu_generation.py; needs .cache/genbench)
#   d2   batch-1 GSM8K generation at 1.7B (CUDA graphs off and on), then 413M unconditional
#   d3   163M unconditional at L = 2048 and 1024, T up to 256, CUDA graphs off and on
#   d4   batch-1 GSM8K generation at 1.7B, AR and Eso-LM: CUDA graphs over the compiled model
#        (InferenceModel.compile) beside plain graphs
#   d5   the same for MDLM and Duo
#        (d2 to d5 first run tests/test_cuda_graphs.py, once per warm machine: graphs are timed
#        only if it passes)
#        (d to d5 are docs/gpu.md's generation commands, "Still to measure: generation")
#   e1   TransformerEngine: join the core wheel's pieces, check SHA256SUMS, install_gpu_offline.sh, then the
#        tests of both specs loading each other's checkpoints (tests/test_spec_checkpoints.py) and of
#        recompute under FP8 (tests/test_fp8_recompute.py)
#   e2   TransformerEngine steps: bf16 with TE's fused attention, FP8 (delayed, tensorwise; tensorwise
#        with layernorm+mlp_act recompute), and sdpa+fp8 beside the paper's step (with .cache/genbench/paper)
#   e3   TransformerEngine: the loss curves of FP8 against bf16 (MDLM, Duo; 300 iterations of the
#        embedded default), the end within 1.5%? (benchmarks/compare_loss_curves.py)
#   t    the GPU equality tests (attention backends, fusion, reference DiT, test_gpu.py, the Eso-LM
#        kernel, the samplers' CUDA graphs, the training step's full-iteration graph, gradient-
#        accumulation fusion, the recomputed MLP activation, the compiled loss heads)
#
# Every step's output goes to $OUT/NN-STEP.log (a flat folder: at most 8 files come back from a
# call) and $OUT/summary.md, which is also printed at the end: per step its status, seconds and
# the figures (table rows and verdict lines) of its log.
set -uo pipefail

STAGES="s a b b2 c c2 d d2 d3 d4 d5 e1 e2 e3 t"
STAGE=${1:-}
if [[ -z "$STAGE" || "$STAGE" == -h || "$STAGE" == --help ]]; then
  sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit 2
fi
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
DRY=${DRY:-0}
if [[ "$STAGE" == all ]]; then
  [[ $DRY == 1 ]] || { echo "error: 'all' only as a dry run (DRY=1): one stage fits one device call" >&2; exit 2; }
  failed=0
  for s in $STAGES; do
    OUT="${OUT:-/tmp/gpu-runbook-dry}/$s" "$0" "$s" || failed=1
  done
  exit $failed
fi
[[ " $STAGES " == *" $STAGE "* ]] || { echo "error: stage $STAGE: expected one of: $STAGES (or all)" >&2; exit 2; }

PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu-runbook-$STAGE}
mkdir -p "$OUT"
BUDGET=${STAGE_BUDGET:-510}
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
SUMMARY="$OUT/summary.md"
STEPS_DONE=()

# Sizes: the measurement, or the smallest that exercises the same code on a CPU
if [[ $DRY == 1 ]]; then
  PRESET=cpu-micro SEQ=64 VOCAB=4097 ROUNDS=1 WARMUP=1 STEPS=1 MAXMB=2 GBS=2 PROFILE_STEPS=1 SDPA_MB=2 CURVE_ITERS=20 LOSS_BATCH=1
  SDPA_SHAPE=(--heads 2 --head-dim 16 --seq 64) REGIONS=(--shapes 32x64 256x64 --dtype float32 --repeats 1)
  GEN_BIG=cpu-micro GEN_MID=cpu-micro GEN_SMALL=cpu-micro GEN_L=32 GEN_L2=16 GEN_T="4" GEN_T3="4 8"
  GEN_SIZE="--vocab 32001 --max-batch 2 --max-new-tokens 6" GEN_PROMPTS=2  # the tokenizer of the GSM8K rows has 32,001 ids
else
  PRESET=1.7B SEQ=2048 VOCAB=32001 ROUNDS=6 WARMUP=2 STEPS=5 MAXMB=16 GBS=8 PROFILE_STEPS=5 SDPA_MB=4 CURVE_ITERS=300 LOSS_BATCH=4  # SDPA_MB: what fits at 1.7B
  SDPA_SHAPE=() REGIONS=(--shapes 32x64 2048x2176 8192x2176 --dtype bfloat16)
  GEN_BIG=1708M GEN_MID=413M GEN_SMALL=163M GEN_L=2048 GEN_L2=1024 GEN_T="16 64" GEN_T3="16 64 256"
  GEN_SIZE="" GEN_PROMPTS=4
fi
PAPER_VOCAB_C=32001 PAPER_VOCAB_C2=131072
[[ $DRY == 1 ]] && PAPER_VOCAB_C=4097 PAPER_VOCAB_C2=8193
TE_CORE_PIECES=(.te/pieces/*.part-*)
PAPER=.cache/genbench/paper GSM8K=.cache/genbench/gsm8k.jsonl.gz

# step NAME MAX_SECONDS COMMAND [GATE]: run COMMAND (a bash string) into $OUT/NN-NAME.log under
# the stage's remaining budget. GATE, a pattern: in a dry run, the step passes if the command
# stops with that message (what a CPU lacks: CUDA, TransformerEngine) after parsing its flags.
step() {
  local name=$1 max=$2 cmd=$3 gate=${4:-}
  local n=${#STEPS_DONE[@]} left=$((BUDGET - SECONDS))
  local log
  log="$OUT/$(printf '%02d' $((n + 1)))-$name.log"
  if ((left < 30)); then
    STEPS_DONE+=("$name|SKIPPED (stage budget spent: rerun the stage for it)|0|")
    return
  fi
  local limit=$((max < left - 10 ? max : left - 10)) start=$SECONDS rc status
  echo "+ $cmd" >"$log"
  timeout --signal=TERM --kill-after=15 "$limit" bash -c "set -o pipefail; $cmd" >>"$log" 2>&1
  rc=$?
  if ((rc == 0)); then
    status=ok
  elif ((rc == 124 || rc == 137)); then
    status="TIMEOUT after $limit s"
  elif [[ $DRY == 1 && -n "$gate" ]] && grep -q -- "$gate" "$log"; then
    status="ok (dry run: stops at '${gate//\\|/\' or \'}')"  # \| (grep's or) would split the table cell
  else
    status="FAILED (exit $rc)"
  fi
  STEPS_DONE+=("$name|$status|$((SECONDS - start))|$(basename "$log")")
}

# echo_step NAME COMMAND: a step a dry run only shows (installs)
echo_step() {
  local n=${#STEPS_DONE[@]}
  local log
  log="$OUT/$(printf '%02d' $((n + 1)))-$1.log"
  echo "+ $2" >"$log"
  echo "(dry run: not run)" >>"$log"
  STEPS_DONE+=("$1|shown (dry run)|0|$(basename "$log")")
}

run_or_show() {  # run_or_show NAME MAX COMMAND: an install, run on the GPU machine, shown in a dry run
  if [[ $DRY == 1 ]]; then echo_step "$1" "$3"; else step "$@"; fi
}

install_wheels() {  # the image's missing packages, from the carried .whl (seconds; once per machine)
  if [[ -d .whl ]]; then
    run_or_show install 120 "test -f /tmp/site/.installed || { $PY -m pip install -q --no-index --no-deps \
--no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && touch /tmp/site/.installed; }; \
$PY -c 'import megatron.core, zstandard, omegaconf; print(\"megatron-core\", megatron.core.__version__)'"
  fi
}

build_extensions() {  # optional C++/CUDA extensions (the Python references serve without them)
  run_or_show build_ext 180 "ls megatron_dllm/_esolm_shuffle_cuda*.so >/dev/null 2>&1 || \
TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 $PY setup.py -q build_ext --inplace; \
$PY -c 'import torch, megatron_dllm._esolm_shuffle_cuda; print(\"CUDA extension loads\")'"
}

paper_step() {  # paper_step NAME VOCAB OURS...
  local name=$1 vocab=$2
  shift 2
  if [[ ! -f $PAPER/models/dit.py ]]; then
    STEPS_DONE+=("$name|SKIPPED (no $PAPER/models/dit.py: carry .cache/genbench, see tools/prepare_gpu_carry.sh)|0|")
    return
  fi
  step "$name" 480 "$PY benchmarks/bench_vs_paper_step.py --paper-code $PAPER --preset $PRESET --seq $SEQ \
--vocab $vocab --micro-batches 2 max --max-micro-batch $MAXMB --ours $* --steps $STEPS --warmup 3 --rounds 1" \
    "needs TransformerEngine\|needs a CUDA GPU"
}

train_step() {  # train_step NAME MAX FLAGS...: bench_gpu_train_step.py at the stage's sizes
  local name=$1 max=$2
  shift 2
  step "$name" "$max" "$PY benchmarks/bench_gpu_train_step.py --presets $PRESET --seq $SEQ --vocab $VOCAB \
--steps $STEPS --warmup $WARMUP $*" "needs TransformerEngine"
}

graph_cmd() {  # graph_cmd FLAGS...: train_step's sdpa step through the full-iteration CUDA graph
  echo "$PY benchmarks/bench_gpu_train_step.py --presets $PRESET --seq $SEQ --vocab $VOCAB \
--steps $STEPS --warmup $((WARMUP > 2 ? WARMUP : 2)) --recompute-granularity off --attention-backend sdpa \
--fusion default --cuda-graph $*"
}

graph_step() {  # graph_step NAME MAX FLAGS...: graph_cmd as a step
  local name=$1 max=$2
  shift 2
  step "$name" "$max" "$(graph_cmd "$@")" "needs a CUDA GPU"
}

profile() {  # profile NAME BACKEND MICRO_BATCH KEEP_TRACE [DATA FLAGS...]: KEEP_TRACE 1 copies its gzipped trace to $OUT
  local name=$1 backend=$2 micro=$3 keep=$4
  shift 4
  local trace=/tmp/trace-$name.json copy=true
  ((keep)) && copy="gzip -f $trace && if (( \$(stat -c %s $trace.gz) < 16000000 )); then cp $trace.gz $OUT/; fi"
  step "$name" 240 "$PY benchmarks/bench_profile_breakdown.py --preset $PRESET --seq-length $SEQ --bf16 \
--micro-batch-size $micro --global-batch-size $GBS --attention-backend $backend --steps $PROFILE_STEPS \
--warmup $((PROFILE_STEPS > 1 ? 3 : 1)) --trace $trace $* && $copy" "needs a CUDA GPU"
}

gpu_tests() {  # gpu_tests NAME MAX FILES...: the fast tests of FILES (a dry run only collects them)
  local name=$1 max=$2 tests="-q -n 8 --timeout 170 -rfEs"
  shift 2
  [[ $DRY == 1 ]] && tests="--collect-only -q"
  step "$name" "$max" "$PY -m pytest $tests -p no:cacheprovider $* -k 'not slow or gpu'"
}

case $STAGE in
  s)
    install_wheels
    gpu_tests gpu_tests 180 tests/test_cuda_graph.py tests/test_attention_backend.py tests/test_fusion.py \
      tests/test_reference_dit.py tests/test_gpu.py tests/test_cuda_graphs.py tests/test_batches.py \
      tests/test_profile_breakdown.py tests/test_gradient_accumulation_fusion.py \
      tests/test_vocab_parallel.py::test_compiled_heads_on_the_gpu_equal_the_eager_ones \
      tests/test_throughput.py::test_device_timers_time_the_gpu_without_waiting_for_it
    # the host's dispatch left the GPU idle a fifth of the step on 2026-11-27: the full-iteration
    # graph for every family, then the same step without it (MDLM) beside it
    # (in the same log, as a call returns 8 files) then MDLM's without gradient-accumulation fusion,
    # which is on by default with CUDA: its gain is the ratio to the MDLM row before it
    step step_sdpa_graph 270 "$(graph_cmd --families mdlm duo esolm ar --max-micro-batch $SDPA_MB); rc=\$?; \
$(graph_cmd --families mdlm --max-micro-batch $SDPA_MB --no-gradient-accumulation-fusion) && exit \$rc" \
      "needs a CUDA GPU"
    train_step step_sdpa_fused 80 --families mdlm --recompute-granularity off --attention-backend sdpa \
      --fusion default --max-micro-batch $SDPA_MB
    # micro-batch 8 ran out of memory on 2026-11-27 beside the failed 16's model, which the search
    # did not free then (platform.release_cached_memory): 8 alone, with expandable segments
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True graph_step step_graph_expandable 100 --families mdlm \
      --max-micro-batch $((SDPA_MB * 2))
    # what the graph leaves: its replayed kernels go by their names (training/profile_breakdown.py)
    profile profile_sdpa_graph sdpa $SDPA_MB 1 --transformer-impl local --cuda-graph-impl local \
      --cuda-graph-scope full_iteration --cuda-graph-warmup-steps 1
    ;;
  a)
    install_wheels
    step sdpa_kernel 120 "$PY benchmarks/check_sdpa_kernel.py ${SDPA_SHAPE[*]}"
    # the cross entropy in the logits' storage against megatron-core's (time, peak memory), both heads at
    # 16 MiB fp32 chunks and at their defaults (CE 64 MiB, Duo 16 MiB) and Duo at 128: L2-resident passes
    # or fewer launches? The faster size sets vocab_parallel.CHUNK_ELEMENTS and duo.CHUNK_ELEMENTS (eager).
    # --compiled: both heads as the GPU's training step runs them (--compile-elementwise), all rows a kernel
    step loss_heads 150 "$PY benchmarks/bench_loss_heads.py --bf16 --batch $LOSS_BATCH --seq $SEQ --vocab $VOCAB \
--repeats 5 --ce-chunk-elements 4194304 16777216 --duo-chunk-elements 4194304 33554432 --compiled"
    # the attention's gate + residual and the MLP's norm + modulation as one compiled region against
    # two (the layer ran two until 2026-11-28): 32 tokens time the host, 8192 the passes over memory
    # then, in the same log (a call returns 8 files), the region's graph specialised to the length
    # against its length-dynamic graph, which every micro-batch uses after the first shorter one of
    # --variable-seq-length-prob (CPU: the host's cost about the same, the memory-bound size unsettled)
    step elementwise_regions 180 "$PY benchmarks/bench_elementwise_regions.py ${REGIONS[*]}; rc=\$?; \
$PY benchmarks/bench_elementwise_regions.py ${REGIONS[*]} --compare dynamic && exit \$rc"
    step ab_attention 210 "$PY benchmarks/bench_attention_backend.py --bf16 --presets $PRESET --seqs $SEQ \
--tokens $SEQ --vocab $VOCAB --families mdlm ar --rounds $ROUNDS --warmup $WARMUP"
    step ab_fusion 240 "$PY benchmarks/bench_compile.py --bf16 --presets $PRESET --seqs $SEQ --tokens $SEQ \
--vocab $VOCAB --families mdlm esolm --rounds $ROUNDS --warmup $WARMUP --attention-backend sdpa"
    build_extensions
    ;;
  b)
    install_wheels
    train_step step_sdpa_fused 240 --families mdlm ar --recompute-granularity off --attention-backend sdpa \
      --fusion default --max-micro-batch $MAXMB
    train_step step_sdpa_eager 180 --families mdlm ar --recompute-granularity off --attention-backend sdpa \
      --fusion none --max-micro-batch $MAXMB
    train_step step_local_fused 150 --families mdlm --recompute-granularity off --attention-backend local \
      --fusion default --max-micro-batch 2
    # the phase timers record CUDA events (observability.EventTimer), where megatron-core's synchronised
    # with the GPU 12 times an iteration at the trainer's default level 1: MDLM's step at level 0
    # (Megatron-LM's default, no timers) beside level 1 shows whether timing still costs anything
    for level in 1 0; do
      train_step step_sdpa_timers$level 80 --families mdlm --recompute-granularity off --attention-backend sdpa \
        --fusion default --max-micro-batch $SDPA_MB --timing-log-level $level
    done
    # the NaN guard, on by default since 2026-11-29 as in Megatron-LM: one all-reduce of a flag a step
    train_step step_sdpa_noguard 80 --families mdlm --recompute-granularity off --attention-backend sdpa \
      --fusion default --max-micro-batch $SDPA_MB --timing-log-level 1 --no-check-for-nan-in-loss-and-grad
    # recomputed norms, MLP activation or whole MLP against the micro-batch they let fit: 8 to 16 by
    # the count of bench_activation_memory.py (4 fits without): does the larger batch pay for the recompute?
    train_step step_sdpa_recompute 260 --families mdlm --recompute-granularity mlp_act layernorm+mlp_act \
      layernorm layernorm+mlp \
      --attention-backend sdpa --fusion default --max-micro-batch $MAXMB
    ;;
  b2)
    install_wheels
    profile profile_sdpa sdpa 1 1
    profile profile_local local 1 0
    step optimizer_step 150 "$PY benchmarks/bench_optimizer_step.py --preset $PRESET --vocab $VOCAB \
--steps $((STEPS * 2)) --rounds 3"
    step data_32k 120 "benchmarks/demo_corpus_32k.sh /tmp/demo32k"
    profile profile_sdpa_32k sdpa 1 0 --data-path /tmp/demo32k/shakespeare32k_text_document \
      --tokenizer-type SentencePieceTokenizer --tokenizer-model /tmp/demo32k/spm32k.model
    ;;
  c)
    install_wheels
    paper_step paper_vocab$PAPER_VOCAB_C $PAPER_VOCAB_C sdpa sdpa+layernorm sdpa+graph
    ;;
  c2)
    install_wheels
    # the Nemotron vocabulary's embedding, head and logits take about 7 GiB + 0.4 GiB a sequence more:
    # the MLP activation released too leaves micro-batch 8 more room (RESULTS.md, "Activation memory per layer")
    paper_step paper_vocab$PAPER_VOCAB_C2 $PAPER_VOCAB_C2 sdpa sdpa+layernorm+mlp_act sdpa+graph
    ;;
  d | d2 | d3 | d4 | d5)
    install_wheels
    GEN=benchmarks/bench_gpu_generation.py
    flags=(--presets --lengths --families --steps --sections --cuda-graphs --rounds --max-run-s --budget-s --json
           --paper-code --gsm8k-data --tokenizer-model --prompts --vocab --max-batch --max-new-tokens)
    paper=""
    # the paper's samplers need its code and Lightning (the GPU image has it; a CPU may not)
    if [[ -f $PAPER/algo.py ]] && $PY -c 'import lightning, torchmetrics' 2>/dev/null; then
      paper="--paper-code $PAPER"
    fi
    gen() {  # gen NAME MAX FLAGS...: the generation benchmark, its JSON into $OUT
      local name=$1 max=$2
      shift 2
      step "$name" "$max" "$PY $GEN $paper $GEN_SIZE --rounds 1 $* --json $OUT/$name.json"
    }
    cond() {  # as gen, for the conditional section, which reads the paper's tokenizer (.cache/genbench)
      local tokenizer=$PAPER/tokenizers/tinyllama_tokenizer.model
      if [[ -f $tokenizer ]]; then
        gen "$@" --gsm8k-data $GSM8K --tokenizer-model $tokenizer
      else
        STEPS_DONE+=("$1|SKIPPED (no $tokenizer: carry .cache/genbench, see tools/prepare_gpu_carry.sh)|0|")
      fi
    }
    families="--families esolm ar mdlm duo"
    if [[ ! -f $GEN ]]; then
      STEPS_DONE+=("generation|PENDING: $GEN is not in this checkout yet; stage $STAGE has nothing to run|0|")
    else
      step generation_help 60 "$PY $GEN --help > /tmp/gen-help.txt && for f in ${flags[*]}; do \
grep -q -- \"\$f\" /tmp/gen-help.txt || { echo \"error: $GEN --help lacks \$f: update stage $STAGE in gpu_runbook.sh\"; \
exit 1; }; done; echo 'flags checked: ${flags[*]}'"
      if [[ "${STEPS_DONE[-1]}" != generation_help\|ok\|* ]]; then
        STEPS_DONE+=("generation|SKIPPED (its --help lacks a flag this stage passes: see generation_help)|0|")
      elif [[ $STAGE == d ]]; then
        gen uncond_$GEN_BIG 480 --presets $GEN_BIG --lengths $GEN_L $families --steps $GEN_T \
          --sections unconditional --cuda-graphs off --max-run-s 90 --budget-s 420
      else
        # d2 to d5 time the CUDA-graph variants only once the graph tests pass on this machine; a
        # warm machine remembers a pass of this checkout's tests under this Python, so the next stage
        # skips them
        graphs=off
        passed=/tmp/gpu-runbook-graph-tests-$({ echo "$PY"; cat tests/test_cuda_graphs.py megatron_dllm/sampling/*.py megatron_dllm/hf/modeling_dllm.py; } | md5sum | cut -c1-12)
        if [[ -f $passed ]]; then
          STEPS_DONE+=("graph_tests|ok (passed earlier on this machine: $passed)|0|")
        else
          step graph_tests 180 "$PY -m pytest -q -n 4 -p no:cacheprovider tests/test_cuda_graphs.py && touch $passed"
        fi
        [[ "${STEPS_DONE[-1]}" == graph_tests\|ok* ]] && graphs="off on"
        if [[ $STAGE == d4 || $STAGE == d5 ]]; then
          pair="ar esolm"
          [[ $STAGE == d5 ]] && pair="mdlm duo"
          if [[ $graphs == off ]]; then
            STEPS_DONE+=("cond_compiled|SKIPPED (the graph tests did not pass: see graph_tests)|0|")
          else
            cond cond_compiled_${pair// /_}_$GEN_BIG 420 --presets $GEN_BIG --families $pair \
              --sections conditional --prompts $GEN_PROMPTS --rounds 2 --budget-s 380 --cuda-graphs on compiled
          fi
        elif [[ $STAGE == d2 ]]; then
          cond cond_$GEN_BIG 240 --presets $GEN_BIG --sections conditional --prompts $GEN_PROMPTS --rounds 2 \
            --budget-s 200 --cuda-graphs $graphs
          gen uncond_$GEN_MID 270 --presets $GEN_MID --lengths $GEN_L $families --steps $GEN_T \
            --sections unconditional --cuda-graphs off --budget-s 240
        else
          gen uncond_$GEN_SMALL 480 --presets $GEN_SMALL --lengths $GEN_L $GEN_L2 $families --steps $GEN_T3 \
            --sections unconditional --budget-s 420 --cuda-graphs $graphs
        fi
      fi
    fi
    ;;
  e1)
    if [[ ! -f ${TE_CORE_PIECES[0]} || ! -f .te/wh/SHA256SUMS ]]; then
      STEPS_DONE+=("te_join|SKIPPED (no .te/pieces or .te/wh: tools/prepare_gpu_carry.sh --te, then the calls of docs/gpu.md)|0|")
    else
      core=$(basename "${TE_CORE_PIECES[0]%.part-*}")
      # A dry run joins into /tmp: .te/wh travels with the first call and must stay small
      wh=.te/wh
      [[ $DRY == 1 ]] && wh=/tmp/gpu-runbook-te-wh && rm -rf $wh && cp -r .te/wh $wh
      step te_join 120 "cat ${TE_CORE_PIECES[*]} > $wh/$core && (cd $wh && grep '  $core\$' SHA256SUMS | sha256sum -c -)"
      step te_install 480 "PYTHON=$PY MAX_JOBS=16 tools/install_gpu_offline.sh $wh && \
for w in $wh/transformer_engine_torch-*.whl; do if (( \$(stat -c %s \$w) < 16000000 )); then cp \$w $OUT/; fi; done" \
        "is a CPU build"
      [[ $DRY == 1 ]] && rm -rf $wh
      # TE's layers against the local spec's from one checkpoint, and each loading the other's; the
      # recompute that releases TE linears' inputs under FP8
      gpu_tests te_tests 180 tests/test_spec_checkpoints.py tests/test_fp8_recompute.py
    fi
    ;;
  e2)
    install_wheels
    te=(--transformer-impl transformer_engine --attention-backend fused --recompute-granularity off)
    train_step te_bf16 150 --families mdlm "${te[@]}" --max-micro-batch $MAXMB
    train_step te_fp8_delayed 150 --families mdlm "${te[@]}" --fp8-format hybrid --fp8-recipe delayed \
      --max-micro-batch $MAXMB
    train_step te_fp8_tensorwise 150 --families mdlm "${te[@]}" --fp8-format hybrid --fp8-recipe tensorwise \
      --max-micro-batch $MAXMB
    # the recomputed norms and MLP activation under FP8 (TE's linears keep those inputs unquantized)
    train_step te_fp8_tensorwise_recompute 150 --families mdlm --transformer-impl transformer_engine \
      --attention-backend fused --recompute-granularity layernorm+mlp_act --fp8-format hybrid \
      --fp8-recipe tensorwise --max-micro-batch $MAXMB
    paper_step paper_fp8 $PAPER_VOCAB_C sdpa sdpa+fp8
    ;;
  e3)
    install_wheels
    # FP8 against bf16 (TE's layers): 300 iterations of the embedded default, MDLM and Duo; within 1.5%?
    step fp8_loss_curves 480 "$PY benchmarks/compare_loss_curves.py --families mdlm duo --train-iters $CURVE_ITERS" \
      "need TransformerEngine on a CUDA GPU"
    ;;
  t)
    install_wheels
    build_extensions
    gpu_tests gpu_tests 420 tests/test_attention_backend.py tests/test_fusion.py tests/test_reference_dit.py \
      tests/test_gpu.py tests/test_esolm.py tests/test_cuda_graphs.py tests/test_batches.py tests/test_profile_breakdown.py \
      tests/test_cuda_graph.py tests/test_gradient_accumulation_fusion.py tests/test_mlp_activation_recompute.py \
      tests/test_vocab_parallel.py
    ;;
esac

# The summary: one table of the steps, then the figures each log holds
{
  device=$($PY -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU")' 2>&1)
  echo "# gpu_runbook.sh $STAGE$([[ $DRY == 1 ]] && echo ' (dry run)'): $device, torch $($PY -c 'import torch; print(torch.__version__)' 2>&1), $(date -u +%FT%TZ), $SECONDS s"
  echo
  echo "| step | status | seconds | log |"
  echo "|---|---|---:|---|"
  for s in "${STEPS_DONE[@]}"; do
    IFS='|' read -r name status secs log <<<"$s"
    echo "| $name | $status | $secs | $log |"
  done
  for s in "${STEPS_DONE[@]}"; do
    IFS='|' read -r name status secs log <<<"$s"
    [[ -n "$log" && -f "$OUT/$log" ]] || continue
    echo
    echo "## $name"
    head -1 "$OUT/$log" | cut -c1-400
    grep -E '^\||: forward |^(error|Error)|Traceback|[0-9]+ (passed|failed)|built in|transformer_engine [0-9]|HAVE_TE|OK$|PENDING|flags checked|^of `other`|^[0-9]+ warm-up|(tests|test) collected' \
      "$OUT/$log" | grep -v -- '---|' | tail -40
    if [[ "$status" == FAILED* || "$status" == TIMEOUT* ]]; then
      echo '```'
      tail -15 "$OUT/$log"
      echo '```'
    fi
  done
} >"$SUMMARY"
cat "$SUMMARY"
! grep -q -E '^\| [^|]+ \| (FAILED|TIMEOUT)' "$SUMMARY"
