"""LITPKDS (lit-gpt/TinyLlama packed) import: `tools/convert_dataset.py --from litpkds`.

The fixtures are written by a packer in this file that follows lit-gpt's builder independently of
`megatron_dllm.data.prep.litpkds`: documents packed back to back across fixed-size chunks, one chunk
per file, an unfilled last chunk padded with a separator id. Outputs are read back with
megatron-core's own `IndexedDataset`.
"""
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO_PYTHONPATH

from megatron_dllm.cli.convert_dataset import main as convert_main
from megatron_dllm.data.prep import litpkds

EOS, BOS = 2, 1
CODES = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4, np.dtype(np.int64): 5, np.dtype(np.float32): 6}


def write_litpkds(path, tokens, chunk_size, dtype=np.uint16, magic=b"LITPKDS", version=1, code=None):
    with open(path, "wb") as f:
        f.write(magic + struct.pack("<Q", version) + bytes([CODES[np.dtype(dtype)] if code is None else code])
                + struct.pack("<Q", chunk_size) + np.asarray(tokens, dtype=dtype).tobytes())


def pack(docs, paths, chunk_size, dtype=np.uint16, pad=None):
    """lit-gpt's packing: documents back to back, cut into chunks of `chunk_size`, one per file;
    the last chunk padded with `pad` (or dropped when `pad` is None, as TinyLlama's scripts do).
    Returns the token list of each written file."""
    stream = [t for d in docs for t in d]
    chunks = [stream[i:i + chunk_size] for i in range(0, len(stream), chunk_size)]
    if len(chunks[-1]) < chunk_size:
        if pad is None:
            chunks.pop()
        else:
            chunks[-1] = chunks[-1] + [pad] * (chunk_size - len(chunks[-1]))
    assert len(chunks) == len(paths), (len(chunks), len(paths))
    for path, chunk in zip(paths, chunks):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_litpkds(path, chunk, chunk_size, dtype)
    return chunks


def expected_documents(file_tokens, eos=EOS):
    """Each file split after every EOS; what follows a file's last EOS is one more document."""
    out = []
    for tokens in file_tokens:
        doc = []
        for t in tokens:
            doc.append(t)
            if t == eos:
                out.append(doc)
                doc = []
        if doc:
            out.append(doc)
    return out


def read_megatron(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))], ds.index.dtype


def random_docs(n, seed=0, vocab=500, max_len=40):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, vocab, rng.integers(0, max_len))] + [EOS] for _ in range(n)]


def test_phase1_layout_converts_to_the_documents_in_bucket_order(tmp_path, capsys):
    docs = random_docs(60)
    n_tokens = sum(map(len, docs))
    names = [f"{b}_nemotron_{i:04d}.bin" for b in (0, 1, 2, 10, 255) for i in range(2)]
    chunk = n_tokens // len(names)  # the remainder is dropped, as TinyLlama's scripts do
    files = pack(docs, [str(tmp_path / "corpus" / "train" / n) for n in names], chunk)
    assert convert_main(["--from", "litpkds", str(tmp_path / "corpus" / "train"), "--eos-id", "2",
                         "--output-prefix", str(tmp_path / "out" / "train")]) == 0
    got, dtype = read_megatron(str(tmp_path / "out" / "train"))
    want = expected_documents(files)  # file order of `names`: buckets by value (2 before 10)
    assert got == want and dtype == np.uint16
    # no chunk padding; the last chunk's tail after its final EOS is a partial document, as is
    # every file whose last document continues in the next file
    partial = sum(1 for f in files if f[-1] != EOS)
    summary = capsys.readouterr().out
    assert f"documents: {len(want)}, of which partial (after a file's last EOS): {partial}" in summary
    assert sum(map(len, got)) == len(names) * chunk
    assert not [p for p in os.listdir(tmp_path / "out") if "tmp" in p or "state" in p]


def test_phase2_layout_strips_and_counts_chunk_padding(tmp_path, capsys):
    docs = random_docs(50, seed=1)
    chunk = 128
    n_files = -(-sum(map(len, docs)) // chunk)
    shards = [f"shard_{k}" for k in (0, 1, 2, 10)]
    paths = [str(tmp_path / "train" / shards[i * len(shards) // n_files] / f"part_{i:03d}.bin")
             for i in range(n_files)]
    files = pack(docs, paths, chunk, pad=BOS)
    padding = chunk - (sum(map(len, docs)) % chunk or chunk)
    assert padding > 0
    assert convert_main(["--from", "litpkds", str(tmp_path / "train"), "--eos-id", "2", "--pad-id", "1",
                         "--output-prefix", str(tmp_path / "p2")]) == 0
    got, _ = read_megatron(str(tmp_path / "p2"))
    unpadded = files[:-1] + [files[-1][:chunk - padding]]
    assert got == expected_documents(unpadded)  # documents crossing files come in two pieces
    assert [t for d in got for t in d] == [t for d in docs for t in d]  # the padding is gone
    out = capsys.readouterr()
    assert f"padding tokens stripped: {padding} in 1 files" in out.out
    assert "phase 2" in out.err
    # Without --pad-id the padding stays data, and a file that ends in it is reported.
    assert convert_main(["--from", "litpkds", str(tmp_path / "train"), "--eos-id", "2",
                         "--output-prefix", str(tmp_path / "p2_raw")]) == 0
    raw, _ = read_megatron(str(tmp_path / "p2_raw"))
    assert raw == expected_documents(files)
    assert "looks like chunk padding" in capsys.readouterr().err


def test_padding_with_the_eos_id_keeps_the_eos_that_ends_the_last_document(tmp_path):
    docs = [[5, 6, EOS], [7, EOS], [8, 8, 8, EOS]]
    pack(docs, [str(tmp_path / "d" / "a.bin"), str(tmp_path / "d" / "b.bin")], 7, pad=EOS)
    assert convert_main(["--from", "litpkds", str(tmp_path / "d"), "--eos-id", "2", "--pad-id", "2",
                         "--output-prefix", str(tmp_path / "o")]) == 0
    # files [5 6 2 7 2 8 8] [8 2 2 2 2 2 2]: the second keeps its first EOS, 5 padding ids go
    assert read_megatron(str(tmp_path / "o"))[0] == [[5, 6, EOS], [7, EOS], [8, 8], [8, EOS]]


def test_int32_input_and_block_boundaries(tmp_path):
    """Wide ids (a 128k vocabulary) stay int32; documents cross the read blocks."""
    rng = np.random.default_rng(3)
    docs = [[int(t) for t in rng.integers(1000, 131072, rng.integers(1, 30))] + [EOS] for _ in range(40)]
    chunk = 64
    n = sum(map(len, docs)) // chunk
    files = pack(docs, [str(tmp_path / "in" / f"{i}_x.bin") for i in range(n)], chunk, dtype=np.int32)
    stats = litpkds.convert_litpkds([str(tmp_path / "in")], str(tmp_path / "o"), EOS, block_tokens=5,
                                    log=lambda m: None, progress=False)
    got, dtype = read_megatron(str(tmp_path / "o"))
    assert got == expected_documents(files) and dtype == np.int32
    assert (stats.tokens_read, stats.tokens_written, stats.chunks) == (n * chunk, n * chunk, n)


def test_tokenizer_gives_eos_vocabulary_and_sidecar(tmp_path, capsys):
    """Real text through a SentencePiece tokenizer, packed as TinyLlama's scripts do (encode with
    EOS, sep = BOS), converts back to the documents' ids, with the tokenizer's sidecar."""
    import sentencepiece as spm

    from megatron_dllm.data.indexed_dataset import read_metadata
    from megatron_dllm.data.tokenizers import build_tokenizer

    text = [f"Document {i}: the quick brown fox jumps over {i} lazy dogs." for i in range(30)]
    model = str(tmp_path / "sp.model")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_prefix=model[:-6], vocab_size=300,
                                   model_type="bpe", byte_fallback=True, unk_id=0, bos_id=1, eos_id=2,
                                   pad_id=-1, num_threads=1, minloglevel=2)
    tok = build_tokenizer("SentencePieceTokenizer", model)
    docs = [tok.tokenize(t) + [tok.eod] for t in text]
    pack(docs, [str(tmp_path / "sp" / f"{i}.bin") for i in range(3)], -(-sum(map(len, docs)) // 3), pad=BOS)
    flags = ["--from", "litpkds", str(tmp_path / "sp"), "--tokenizer-type", "SentencePieceTokenizer",
             "--tokenizer-model", model, "--pad-id", "1", "--output-prefix", str(tmp_path / "o")]
    assert convert_main(flags) == 0
    got, dtype = read_megatron(str(tmp_path / "o"))
    assert dtype == np.uint16
    joined = [t for d in got for t in d]
    assert joined == [t for d in docs for t in d]
    assert read_metadata(str(tmp_path / "o"))["vocab_size"] == tok.vocab_size
    assert convert_main(flags + ["--eos-id", "5"]) == 2  # disagrees with the tokenizer's EOS
    # the [MASK] id appended past the model's vocabulary is refused, as training refuses it
    write_litpkds(str(tmp_path / "m.bin"), [5, tok.mask_id, EOS], 3)
    flags[flags.index(str(tmp_path / "sp"))] = str(tmp_path / "m.bin")
    assert convert_main(flags[:-2] + ["--output-prefix", str(tmp_path / "masked")]) == 2
    assert (f"m.bin at byte offset 26: token id {tok.mask_id}, expected 0 <= id < {tok.mask_id} (the tokenizer's "
            f"vocabulary, never its [MASK])") in capsys.readouterr().err


def _corrupt(tmp_path, name, **kw):
    path = str(tmp_path / "bad" / name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tokens = kw.pop("tokens", [3, 4, EOS, 5])
    write_litpkds(path, tokens, kw.pop("chunk_size", 4), **kw)
    return path


@pytest.mark.parametrize("kind, offset, words", [
    ("magic", 0, "bad magic"),
    ("version", 7, "version 2"),
    ("dtype", 15, "dtype code 9"),
    ("chunk0", 16, "chunk size 0"),
    ("size", 24 + 8, "positive multiple"),
    ("truncated", 10, "truncated header"),
    ("mismatch", 16, "expected those of"),
])
def test_corrupt_headers_are_refused_with_file_and_offset(tmp_path, capsys, kind, offset, words):
    good = _corrupt(tmp_path, "0_good.bin")
    if kind == "truncated":
        bad = str(tmp_path / "bad" / "1_bad.bin")
        with open(good, "rb") as f:
            open(bad, "wb").write(f.read(10))
    else:
        kw = {"magic": dict(magic=b"LITPKDX"), "version": dict(version=2), "dtype": dict(code=9),
              "chunk0": dict(chunk_size=0), "size": dict(tokens=[3, 4, EOS, 5, 6], chunk_size=4),
              "mismatch": dict(chunk_size=2)}[kind]
        bad = _corrupt(tmp_path, "1_bad.bin", **kw)
    capsys.readouterr()
    assert convert_main(["--from", "litpkds", str(tmp_path / "bad"), "--eos-id", "2",
                         "--output-prefix", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {bad} at byte offset {offset}: ") and words in err[0]
    assert not os.path.exists(tmp_path / "o.idx") and not os.path.exists(tmp_path / "o.bin")
    assert convert_main(["--from", "litpkds", "--validate", str(tmp_path / "bad")]) == 2
    out = capsys.readouterr()
    assert f"ok {good}" in out.out and f"BAD {bad} at byte offset {offset}" in out.out
    assert out.err.startswith("error: 1 of 2 LITPKDS files are invalid")


def test_bad_flags_and_ids(tmp_path, capsys):
    write_litpkds(str(tmp_path / "a.bin"), [3, 4, EOS, 5], 4)
    write_litpkds(str(tmp_path / "f.bin"), [3, 4, EOS, 5], 4, dtype=np.float32)
    write_litpkds(str(tmp_path / "neg.bin"), [3, -4, EOS, 5], 4, dtype=np.int32)
    write_litpkds(str(tmp_path / "i64.bin"), [3, 4, EOS, 2**40], 4, dtype=np.int64)  # int32 output, no tokenizer
    os.makedirs(tmp_path / "root" / "train")
    cases = [
        (["a.bin"], "--eos-id is required"),
        (["a.bin", "--eos-id", "70000"], "--eos-id 70000 cannot occur in uint16 data"),
        (["f.bin", "--eos-id", "2"], "float32 chunks, expected integer token ids"),
        (["neg.bin", "--eos-id", "2"], f"{tmp_path / 'neg.bin'} at byte offset 28: token id -4"),
        (["i64.bin", "--eos-id", "2"], f"{tmp_path / 'i64.bin'} at byte offset 48: token id 1099511627776, "
                                       f"expected 0 <= id < 2147483648 (what the int32 output holds)"),
        (["root", "--eos-id", "2"], "is a corpus root holding train/"),
        (["missing.bin", "--eos-id", "2"], "no such file or directory"),
        (["a.bin", "a.bin", "--eos-id", "2"], "is listed twice"),
    ]
    for args, words in cases:
        argv = ["--from", "litpkds", *[str(tmp_path / a) if a.endswith((".bin", "root")) else a for a in args],
                "--output-prefix", str(tmp_path / "o")]
        assert convert_main(argv) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert [e for e in err if e.startswith("error")] == err[-1:] and words in err[-1], (args, err)


def _inputs(tmp_path, n_files=6):
    docs = random_docs(80, seed=7)
    pack(docs, [str(tmp_path / "in" / f"{i}_f.bin") for i in range(n_files)], sum(map(len, docs)) // n_files)
    return str(tmp_path / "in")


def _bytes(prefix):
    return open(prefix + ".bin", "rb").read(), open(prefix + ".idx", "rb").read()


def test_failed_run_resumes_without_redoing_finished_files(tmp_path, monkeypatch):
    src = _inputs(tmp_path)
    quiet = dict(log=lambda m: None, progress=False, sync_interval=0)  # sync after every file
    litpkds.convert_litpkds([src], str(tmp_path / "whole"), EOS, **quiet)

    original, calls = litpkds._convert_file, []

    def failing_at_file_3(header, *args):
        calls.append(os.path.basename(header.path))
        if len(calls) == 4:
            original(header, *args)  # half-written file 3: its tokens reach the temporaries
            raise OSError(28, "No space left on device", str(tmp_path / "r.bin.tmp-convert"))
        return original(header, *args)

    monkeypatch.setattr(litpkds, "_convert_file", failing_at_file_3)
    with pytest.raises(ValueError, match="No space left"):
        litpkds.convert_litpkds([src], str(tmp_path / "r"), EOS, **quiet)
    assert not os.path.exists(tmp_path / "r.idx") and not os.path.exists(tmp_path / "r.bin")
    state = json.load(open(tmp_path / "r.convert-state.json"))
    assert state["files_done"] == 3
    calls.clear()
    stats = litpkds.convert_litpkds([src], str(tmp_path / "r"), EOS, **quiet)
    assert calls == ["3_f.bin", "4_f.bin", "5_f.bin"] and stats.files_resumed == 3
    assert _bytes(str(tmp_path / "r")) == _bytes(str(tmp_path / "whole"))
    monkeypatch.setattr(litpkds, "_convert_file", original)
    whole = litpkds.convert_litpkds([src], str(tmp_path / "whole2"), EOS, **quiet)
    assert (stats.documents, stats.partial_documents) == (whole.documents, whole.partial_documents)
    assert sorted(os.listdir(tmp_path)) == ["in", "r.bin", "r.idx", "whole.bin", "whole.idx",
                                            "whole2.bin", "whole2.idx"]


KILLER = """
import os, signal, sys
from megatron_dllm.data.prep import litpkds
original, seen = litpkds._convert_file, []
def killed_in_file_2(header, *args):
    seen.append(header.path)
    if len(seen) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return original(header, *args)
litpkds._convert_file = killed_in_file_2
from megatron_dllm.cli.convert_dataset import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_sigkilled_run_resumes_to_identical_output(tmp_path):
    src = _inputs(tmp_path)
    argv = ["--from", "litpkds", src, "--eos-id", "2", "--no-progress", "--sync-interval", "0"]
    env = {**os.environ, "PYTHONPATH": REPO_PYTHONPATH}
    killed = subprocess.run([sys.executable, "-c", KILLER, *argv, "--output-prefix", str(tmp_path / "k")],
                            env=env, capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    assert not os.path.exists(tmp_path / "k.idx")
    assert json.load(open(tmp_path / "k.convert-state.json"))["files_done"] == 2
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    cut_short = tmp_path / f"k.convert-state.json.tmp-{dead.stdout.strip()}-deadbeef"  # killed in a state write
    cut_short.write_text('{"files')
    assert convert_main(argv + ["--output-prefix", str(tmp_path / "k")]) == 0
    assert not [p for p in os.listdir(tmp_path) if p.startswith("k.") and ("tmp" in p or "state" in p)]
    assert convert_main(argv + ["--output-prefix", str(tmp_path / "once")]) == 0
    assert _bytes(str(tmp_path / "k")) == _bytes(str(tmp_path / "once"))


def test_changed_inputs_start_over(tmp_path, monkeypatch):
    src = _inputs(tmp_path)
    original = litpkds._convert_file

    def fail_second(header, *args):
        if header.path.endswith("1_f.bin"):
            raise KeyboardInterrupt
        return original(header, *args)

    monkeypatch.setattr(litpkds, "_convert_file", fail_second)
    with pytest.raises(KeyboardInterrupt):
        litpkds.convert_litpkds([src], str(tmp_path / "o"), EOS, log=lambda m: None, progress=False,
                                sync_interval=0)
    assert os.path.exists(tmp_path / "o.convert-state.json")
    monkeypatch.setattr(litpkds, "_convert_file", original)
    os.remove(os.path.join(src, "5_f.bin"))  # another input list: the saved state does not apply
    logs = []
    stats = litpkds.convert_litpkds([src], str(tmp_path / "o"), EOS, log=logs.append, progress=False)
    assert stats.files_resumed == 0 and any("starting over" in m for m in logs)
    litpkds.convert_litpkds([src], str(tmp_path / "fresh"), EOS, log=lambda m: None, progress=False)
    assert _bytes(str(tmp_path / "o")) == _bytes(str(tmp_path / "fresh"))


def test_a_file_of_several_chunks_converts_like_one_file_per_chunk(tmp_path):
    docs = random_docs(30, seed=5)
    chunk = sum(map(len, docs)) // 3
    files = pack(docs, [str(tmp_path / "one" / f"{i}.bin") for i in range(3)], chunk)
    write_litpkds(str(tmp_path / "three.bin"), [t for f in files for t in f], chunk)
    assert litpkds.read_header(str(tmp_path / "three.bin")).num_chunks == 3
    quiet = dict(log=lambda m: None, progress=False)
    litpkds.convert_litpkds([str(tmp_path / "three.bin")], str(tmp_path / "o"), EOS, **quiet)
    assert read_megatron(str(tmp_path / "o"))[0] == expected_documents([[t for f in files for t in f]])
