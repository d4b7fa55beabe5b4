"""Records what Megatron-LM's own `tools/preprocess_data.py` writes for `fixture.jsonl` into
`recorded.json` (md5 of every .bin/.idx); `tests/test_megatron_tiktoken.py` then runs this
project's preprocessing with the same flags and compares. Run it again only to re-record:

    pip install --no-deps mistral-common==1.13.1
    git --git-dir=<Megatron-LM clone>/.git archive core_v0.16.1 | tar -x -C /tmp/mlm
    python tests/data/megatron_tiktoken/record_megatron.py /tmp/mlm

The vocabulary is the `"vocab"` list of mistral-common's `data/tekken_240911.json` (150,000
records in Megatron-LM's TikTokenizer JSON format), written out as its own JSON file.
Megatron-LM is imported from the given tree (its `megatron.training` is not on PyPI). The one
module of that tree that imports triton at import time (GPU batch-invariant kernels, unused by
preprocessing) is replaced by an empty stand-in, so the script runs on a CPU machine.
"""
import hashlib
import json
import os
import runpy
import subprocess
import sys
import tempfile
import types

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "fixture.jsonl")
COMMON = ["--input", FIXTURE, "--tokenizer-type", "TikTokenizer", "--workers", "1"]
CASES = {  # name -> flags after COMMON, --tokenizer-model and --output-prefix
    "v2": ["--tiktoken-pattern", "v2"],
    "v2_eod": ["--tiktoken-pattern", "v2", "--append-eod"],
    "v1_eod": ["--tiktoken-pattern", "v1", "--append-eod"],
    "v2_eod_vocab32000": ["--tiktoken-pattern", "v2", "--append-eod", "--vocab-size", "32000"],
    "v2_eod_vocab100000": ["--tiktoken-pattern", "v2", "--append-eod", "--vocab-size", "100000"],
    "v2_eod_specials": ["--tiktoken-pattern", "v2", "--append-eod", "--vocab-size", "50000",
                        "--tiktoken-num-special-tokens", "100", "--tokenizer-special-tokens",
                        "<unk>", "<s>", "</s>", "<pad>", "<mask>", "<cls>", "<sep>", "<|im_start|>", "<|im_end|>"],
}


def write_vocabulary(path: str) -> None:
    import mistral_common

    src = os.path.join(os.path.dirname(mistral_common.__file__), "data", "tekken_240911.json")
    with open(src, encoding="utf-8") as f:
        vocab = json.load(f)["vocab"]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(vocab, f)


def md5(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.md5(f.read()).hexdigest()


def run_megatron(tree: str, argv) -> None:
    """In this process: Megatron-LM's preprocess_data.py with `argv`."""
    name = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
    stub = types.ModuleType(name)
    stub.enable_batch_invariant_mode = stub.disable_batch_invariant_mode = lambda *a, **k: None
    stub.set_batch_invariant_mode = lambda *a, **k: None
    stub.is_batch_invariant_mode_enabled = lambda: False
    sys.modules[name] = stub
    sys.path.insert(0, tree)
    script = os.path.join(tree, "tools", "preprocess_data.py")
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


def main() -> None:
    if sys.argv[1] == "--one":  # child: one Megatron-LM run
        run_megatron(sys.argv[2], sys.argv[3:])
        return
    tree = sys.argv[1]
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        vocab = os.path.join(tmp, "vocab.json")
        write_vocabulary(vocab)
        for name, flags in CASES.items():
            prefix = os.path.join(tmp, name)
            argv = COMMON + ["--tokenizer-model", vocab, "--output-prefix", prefix] + flags
            subprocess.run([sys.executable, __file__, "--one", tree, *argv], check=True)
            out = f"{prefix}_text_document"
            cases.append({"name": name, "flags": flags, "bin_md5": md5(out + ".bin"),
                          "idx_md5": md5(out + ".idx"), "bin_bytes": os.path.getsize(out + ".bin")})
    record = {
        "megatron_lm": "tag core_v0.16.1 (commit 55ac7082517c3878ae653c07c09c534b8aed49f6), tools/preprocess_data.py",
        "vocabulary": "mistral-common==1.13.1 data/tekken_240911.json, its 'vocab' list as a JSON file",
        "command": "python tools/preprocess_data.py " + " ".join(
            ["--input", "tests/data/megatron_tiktoken/fixture.jsonl"] + COMMON[2:]
            + ["--tokenizer-model", "vocab.json", "--output-prefix", "OUT", "<flags>"]),
        "recorded_with": "tests/data/megatron_tiktoken/record_megatron.py",
        "cases": cases,
    }
    with open(os.path.join(HERE, "recorded.json"), "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
