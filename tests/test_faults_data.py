"""Data-side faults: nothing lost, nothing silent.

Truncated or corrupt inputs, a key no record has, a read-only or full output disk, a killed
preprocessing parent, index caches holding pickles, and a tokenizer that differs from the one
the data was made with. Every case is made for real (compressed files cut short, a Parquet page
overwritten, tmpfs mounts, SIGKILL, crafted .npy files) and checked for its message, its exit
code, and that inputs and earlier outputs are byte-identical afterwards with nothing new published.
"""

import glob
import gzip
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import REPO, launch_env, run_python, tmpfs
from interruptions import interrupt_before_publishing, pool_workers

from megatron_dllm.data.datasets import build_datasets, check_prefix, load_index_cache
from megatron_dllm.data.indexed_dataset import meta_path, read_metadata
from megatron_dllm.data.prep.demo import prepare_demo_corpus
from megatron_dllm.data.prep.preprocess import preprocess, shard_prefix
from megatron_dllm.data.tokenizers import build_tokenizer, tokenizer_fingerprint

SP = "SentencePieceTokenizer"
QUIET = dict(log=lambda m: None)


# ---------------------------------------------------------------- helpers and fixtures


def _jsonl(records, key="text") -> bytes:
    return b"".join(json.dumps({key: r, "id": i}).encode() + b"\n" for i, r in enumerate(records))


def _zst(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(write_checksum=True).compress(data)  # as the zstd CLI writes


def _snapshot(*dirs):
    """{path: bytes} of every file under `dirs`."""
    out = {}
    for d in dirs:
        for root, _, names in os.walk(d):
            for n in names:
                with open(os.path.join(root, n), "rb") as f:
                    out[os.path.join(root, n)] = f.read()
    return out


def _tool(name, *args):
    return run_python([os.path.join(REPO, "tools", name), *map(str, args)], REPO, launch_env(1), 120)


def _one_error_line(r, *needles):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _same_outputs(before, directory):
    """Earlier outputs byte-identical, and nothing else there (no temporaries, no new files)."""
    assert _snapshot(directory) == before


# ---------------------------------------------------------------- truncated / corrupt inputs


def _cut(data: bytes) -> bytes:
    return data[: len(data) // 3]


def _flip(data: bytes) -> bytes:
    mid = len(data) // 2
    return data[:mid] + bytes(b ^ 0xFF for b in data[mid:mid + 8]) + data[mid + 8:]


@pytest.mark.parametrize("suffix,compress,damage", [
    (".jsonl.zst", _zst, _cut), (".jsonl.gz", gzip.compress, _cut),
    (".jsonl.zst", _zst, _flip), (".jsonl.gz", gzip.compress, _flip),
], ids=["zst-truncated", "gz-truncated", "zst-corrupt", "gz-corrupt"])
def test_damaged_compressed_input_stops_and_publishes_nothing(tmp_path, sp_model, paragraphs, suffix,
                                                              compress, damage):
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    good = inp / f"a{suffix}"
    good.write_bytes(compress(_jsonl(paragraphs[:300])))
    bad = inp / f"b{suffix}"
    bad.write_bytes(damage(compress(_jsonl(paragraphs[300:700]))))
    # an earlier run's outputs (shard 0 of 2 holds the good file and is finished) stay as they were
    kw = dict(append_eod=True, num_shards=2, **QUIET)
    preprocess([str(good), str(bad)], str(out / "c"), SP, sp_model, shard_index=0, **kw)
    before = _snapshot(inp, out)
    with pytest.raises(ValueError, match=rf"--input '{re.escape(str(bad))}': truncated or corrupt, reading "
                                         rf"stopped after line \d+ "
                                         rf"\(at byte \d+ of the {bad.stat().st_size}-byte file\)"):
        preprocess([str(good), str(bad)], str(out / "c"), SP, sp_model, shard_index=1, **kw)
    assert _snapshot(inp, out) == before  # no shard 1 dataset, sidecar, rejections or .done.json


@pytest.mark.parametrize("case", ["zst-truncated", "parquet-without-column", "sft-gz-truncated"])
def test_cli_bad_input_is_one_error_line_exit_2(tmp_path, sp_model, paragraphs, case):
    """Today's silent outcomes (5,722 of 20,000 documents; an empty dataset) are now errors."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    tool, flags = "preprocess_data.py", ["--workers", "2"]
    if case == "zst-truncated":
        src = tmp_path / "in.jsonl.zst"
        src.write_bytes(_cut(_zst(_jsonl(paragraphs[:400]))))
        needles = [str(src), "truncated or corrupt, reading stopped after line"]
    elif case == "sft-gz-truncated":
        src = tmp_path / "in.jsonl.gz"
        records = [{"prompt": p, "response": r} for p, r in zip(paragraphs[:400:2], paragraphs[1:400:2])]
        src.write_bytes(_cut(gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in records))))
        tool, flags = "preprocess_sft_data.py", ["--seq-length", "512"]
        needles = [str(src), "truncated or corrupt, reading stopped after line"]
    else:  # known from the schema: refused before any tokenizing
        src = tmp_path / "in.parquet"
        pq.write_table(pa.table({"body": paragraphs[:400]}), src)
        needles = [str(src), "--json-keys text", "has no column 'text'; its columns are ['body']"]
    before = _snapshot(tmp_path)
    r = _tool(tool, "--input", src, "--output-prefix", tmp_path / "out" / "c",
              "--tokenizer-type", SP, "--tokenizer-model", sp_model, *flags)
    _one_error_line(r, *needles)
    assert _snapshot(tmp_path) == before


def test_damaged_parquet_stops_naming_file_and_row(tmp_path, sp_model, paragraphs):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"text": paragraphs[:400]}), path, row_group_size=100)
    raw = path.read_bytes()
    chunk = pq.ParquetFile(path).metadata.row_group(2).column(0)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    # row groups 0, 1 read; the first page header of row group 2 no longer decodes
    corrupt = bytearray(raw)
    corrupt[start:start + 8] = bytes(b ^ 0xFF for b in corrupt[start:start + 8])
    path.write_bytes(bytes(corrupt))
    before = _snapshot(tmp_path)
    with pytest.raises(ValueError, match=rf"--input '{re.escape(str(path))}': corrupt Parquet data, reading "
                                         r"stopped after row 200 of 400"):
        preprocess([str(path)], str(tmp_path / "c"), SP, sp_model, workers=2, parquet_batch_rows=100, **QUIET)
    assert _snapshot(tmp_path) == before
    path.write_bytes(raw[: len(raw) // 2])  # cut short: the footer is gone
    with pytest.raises(ValueError, match=rf"--input '{re.escape(str(path))}': not a readable Parquet file, "
                                         r"nothing read"):
        preprocess([str(path)], str(tmp_path / "c"), SP, sp_model, **QUIET)


def test_key_missing_from_every_record_stops_naming_the_keys_there(tmp_path, sp_model, paragraphs):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "a.jsonl"
    src.write_bytes(_jsonl(paragraphs[:200], key="body"))
    with pytest.raises(ValueError, match=r"--json-keys text: none of the 200 records of .*a.jsonl has this "
                                         r"key .*their keys are \['body', 'id'\]"):
        preprocess([str(src)], str(tmp_path / "out" / "a"), SP, sp_model, workers=2, **QUIET)
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []
    # Parquet: the schema says so before anything is tokenized, even with an unreadable
    # (truncated) input sorted before it that tokenizing would reach first
    (tmp_path / "a.jsonl.gz").write_bytes(_cut(gzip.compress(_jsonl(paragraphs[:200]))))
    pq.write_table(pa.table({"body": paragraphs[:50], "id": list(range(50))}), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match=r"--json-keys text: .*b.parquet has no column 'text'; "
                                         r"its columns are \['body', 'id'\]"):
        preprocess([str(tmp_path / "a.jsonl.gz"), str(tmp_path / "b.parquet")], str(tmp_path / "out" / "b"),
                   SP, sp_model, **QUIET)
    # occasional missing keys are rejected, counted and listed, as before
    src.write_bytes(_jsonl(paragraphs[:200]) + _jsonl(paragraphs[:3], key="body"))
    st = preprocess([str(src)], str(tmp_path / "out" / "c"), SP, sp_model, **QUIET)
    assert st.keys["text"].written == 200 and dict(st.keys["text"].rejected) == {"missing_key": 3}
    assert open(st.rejections_files["text"]).read().count("\tmissing_key\n") == 3


def test_a_run_that_writes_no_document_stops_and_publishes_nothing(tmp_path, sp_model):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_bytes(_jsonl(["", ""]))
    for name, message in [("empty", r"no document for key 'text' in its 0 records; nothing written"),
                          ("blank", r"no document for key 'text' in its 2 records \(rejected: 2 empty_text\)")]:
        with pytest.raises(ValueError, match=rf"--input .*{name}.jsonl: {message}"):
            preprocess([str(tmp_path / f"{name}.jsonl")], str(tmp_path / "out" / name), SP, sp_model, **QUIET)
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []


# ---------------------------------------------------------------- read-only / full output disk


def test_read_only_output_directory(tmp_path, sp_model, paragraphs):
    src = tmp_path / "in.jsonl"
    src.write_bytes(_jsonl(paragraphs[:300]))
    with tmpfs(tmp_path / "ro", "1m") as ro:
        preprocess([str(src)], os.path.join(ro, "c"), SP, sp_model, **QUIET)  # an earlier run's outputs
        subprocess.run(["mount", "-o", "remount,ro", ro], check=True)
        before = _snapshot(ro)
        r = _tool("preprocess_data.py", "--input", src, "--output-prefix", os.path.join(ro, "c"),
                  "--tokenizer-type", SP, "--tokenizer-model", sp_model)
        _one_error_line(r, f"--output-prefix {ro}/c: cannot write to {ro} (Read-only file system)")
        _same_outputs(before, ro)


def test_full_output_disk(tmp_path, sp_model, paragraphs):
    src = tmp_path / "in.jsonl"
    src.write_bytes(_jsonl(paragraphs))  # ~85 KB of tokens: more than the disk has left
    small = tmp_path / "small.jsonl"
    small.write_bytes(_jsonl(paragraphs[:100]))
    with tmpfs(tmp_path / "full", "64k") as full:
        stats = preprocess([str(small)], os.path.join(full, "c"), SP, sp_model, **QUIET)
        before, inputs = _snapshot(full), _snapshot(src)
        r = _tool("preprocess_data.py", "--input", src, "--output-prefix", os.path.join(full, "c"),
                  "--tokenizer-type", SP, "--tokenizer-model", sp_model, "--workers", "2",
                  "--overwrite")  # replacing them: they are kept whole until the new ones are complete
        _one_error_line(r, f"--output-prefix {full}/c: cannot write {full}", "(No space left on device)")
        _same_outputs(before, full)
        assert _snapshot(src) == inputs
        # merging into the full disk: the same, from merge_datasets.py
        big = preprocess([str(src)], str(tmp_path / "big"), SP, sp_model, **QUIET).output_prefixes["text"]
        r = _tool("merge_datasets.py", "--input", big, stats.output_prefixes["text"],
                  "--output-prefix", os.path.join(full, "m"))
        _one_error_line(r, f"--output-prefix {full}/m: cannot write", "(No space left on device)")
        _same_outputs(before, full)


# ---------------------------------------------------------------- workers end with their parent


def test_workers_exit_when_the_parent_is_sigkilled(tmp_path, demo_cache, sp_model):
    import psutil

    corpus = prepare_demo_corpus(demo_cache)["data_prefix"]
    plays = os.path.join(os.path.dirname(corpus), "train.jsonl")  # 41 plays, ~5 MB
    (tmp_path / "in").mkdir()
    for i in range(4):
        os.symlink(plays, tmp_path / "in" / f"p{i}.jsonl")
    out = tmp_path / "out"
    argv = [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input",
            str(tmp_path / "in" / "*.jsonl"), "--output-prefix", str(out / "c"), "--tokenizer-type", SP,
            "--tokenizer-model", sp_model, "--workers", "2", "--chunksize", "1"]

    def tokenizing(p):  # both workers have returned tokens to the parent
        return out.is_dir() and any(".bin.tmp-" in f and os.path.getsize(out / f) for f in os.listdir(out))

    workers = []

    def kill_parent(p):  # SIGKILL: the parent gets no chance to stop its pool
        workers.extend(pool_workers(p))
        p.kill()

    outputs = [str(out / f"c_text_document{ext}") for ext in (".bin", ".idx", ".meta.json")]
    interrupt_before_publishing(argv, tokenizing, outputs, kill_parent)
    assert len(workers) == 2

    def alive(proc):
        try:
            return proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.time() + 5
    while any(map(alive, workers)) and time.time() < deadline:
        time.sleep(0.05)
    left = [w.pid for w in workers if alive(w)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"preprocessing workers {left} outlived their killed parent"
    assert not any(map(os.path.exists, outputs))


# ---------------------------------------------------------------- shard rejections are merged


def test_shard_rejections_are_merged_in_shard_order(tmp_path, sp_model, paragraphs):
    files = []
    for i in range(3):  # every file: good records, some bad ones, titles on some
        lines = [json.dumps({"text": t, **({"title": f"t{i}"} if j % 4 == 0 else {})}).encode()
                 for j, t in enumerate(paragraphs[100 * i:100 * i + 60])]
        lines[7 + i] = b'{"text": "unterminated'
        lines[20] = json.dumps({"body": "no text"}).encode()
        files.append(tmp_path / f"f{i}.jsonl")
        files[-1].write_bytes(b"\n".join(lines) + b"\n")
    keys = ["text", "title"]
    one = preprocess(list(map(str, files)), str(tmp_path / "one"), SP, sp_model, json_keys=keys, **QUIET)
    out = str(tmp_path / "sh" / "c")
    for i in range(3):
        preprocess(list(map(str, files)), out, SP, sp_model, json_keys=keys, num_shards=3, shard_index=i, **QUIET)
        assert all(os.path.isfile(shard_prefix(out, i, 3) + f"_{key}_document_rejected.tsv") for key in keys)
    for key in keys:
        single = open(one.rejections_files[key]).read().splitlines()
        merged = str(tmp_path / f"merged_{key}")
        r = _tool("merge_datasets.py", "--input", f"{out}_shard*_{key}_document", "--output-prefix", merged)
        assert r.returncode == 0, r.stderr
        rows = open(merged + "_rejected.tsv").read().splitlines()
        # = the single run's rows for this key, in file (= shard) order
        assert rows == single and {row.split("\t")[2] for row in rows[1:]} == {key}
        assert [row.split("\t")[0] for row in rows[1:]] == sorted(row.split("\t")[0] for row in rows[1:])
        assert len(rows) - 1 == sum(one.keys[key].rejected.values())


def test_a_run_of_another_key_leaves_the_first_keys_rejections_alone(tmp_path, sp_model, paragraphs):
    """Each dataset's report lies beside it, under its lock: a second run into the same output
    prefix that writes another key neither needs --overwrite nor touches the first key's report."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join([json.dumps({"text": t, "title": "a title"}).encode() for t in paragraphs[:40]]
                               + [b'{"text": "unterminated', json.dumps({"title": "no text"}).encode()]) + b"\n")
    out = str(tmp_path / "out" / "c")
    text = preprocess([str(src)], out, SP, sp_model, json_keys=["text"], **QUIET)
    report = text.rejections_files["text"]
    assert report == out + "_text_document_rejected.tsv"
    before = open(report).read()
    assert before.count("\ttext\t") == 2
    for overwrite in (False, True):
        title = preprocess([str(src)], out, SP, sp_model, json_keys=["title"], overwrite=overwrite, **QUIET)
        assert title.rejections_files == {"title": out + "_title_document_rejected.tsv"}
        assert open(report).read() == before
    # rerun of the text key with no rejections left: its stale report goes, the title's stays
    src.write_bytes(_jsonl(paragraphs[:40]))
    preprocess([str(src)], out, SP, sp_model, json_keys=["text"], overwrite=True, **QUIET)
    assert not os.path.exists(report) and os.path.exists(out + "_title_document_rejected.tsv")


# ---------------------------------------------------------------- tokenizer identity


@pytest.fixture(scope="module")
def other_sp_model(tmp_path_factory, sp_model):
    """The demo model with two pieces swapped: same file name, same vocabulary size, other ids."""
    from sentencepiece import sentencepiece_model_pb2

    m = sentencepiece_model_pb2.ModelProto()
    m.ParseFromString(open(sp_model, "rb").read())
    m.pieces[500].piece, m.pieces[501].piece = m.pieces[501].piece, m.pieces[500].piece
    path = tmp_path_factory.mktemp("other") / os.path.basename(sp_model)
    path.write_bytes(m.SerializeToString())
    return str(path)


def test_tokenizer_fingerprint(tmp_path, sp_model):
    import hashlib

    import tokenizers

    tok = build_tokenizer(SP, sp_model)
    assert tokenizer_fingerprint(tok) == tokenizer_fingerprint(sp_model) == \
        hashlib.sha256(open(sp_model, "rb").read()).hexdigest()  # = sha256sum of the .model
    # A HuggingFace directory: tokenizer.json and tokenizer_config.json (which names eos/bos)
    hf = tmp_path / "hf"
    hf.mkdir()
    t = tokenizers.Tokenizer(tokenizers.models.WordLevel({"</s>": 0, "a": 1, "b": 2}, unk_token="a"))
    t.save(str(hf / "tokenizer.json"))
    plain = tokenizer_fingerprint(str(hf))
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (hf / "README.md").write_text("not part of the tokenizer")
    fp = tokenizer_fingerprint(str(hf))
    assert fp != plain and fp == tokenizer_fingerprint(str(hf / "tokenizer.json")) == \
        tokenizer_fingerprint(build_tokenizer("HuggingFaceTokenizer", str(hf)))
    os.rename(hf, tmp_path / "moved")
    assert tokenizer_fingerprint(str(tmp_path / "moved")) == fp  # content, not location
    (tmp_path / "moved" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "b"}))
    assert tokenizer_fingerprint(str(tmp_path / "moved")) != fp
    with pytest.raises(ValueError, match="--tokenizer-model .*nowhere.model"):
        tokenizer_fingerprint(str(tmp_path / "nowhere.model"))


def test_a_tokenizer_with_another_hash_is_refused(tmp_path, sp_model, other_sp_model, paragraphs):
    from megatron_dllm.config.data import DataConfig, TokenizerConfig
    from megatron_dllm.evaluation.nelbo import validation_run

    src = tmp_path / "in.jsonl"
    src.write_bytes(_jsonl(paragraphs[:300]))
    prefix = preprocess([str(src)], str(tmp_path / "a"), SP, sp_model, append_eod=True,
                        **QUIET).output_prefixes["text"]
    meta = read_metadata(prefix)
    assert meta["tokenizer_sha256"] == tokenizer_fingerprint(sp_model)
    tok, other = build_tokenizer(SP, sp_model), build_tokenizer(SP, other_sp_model)
    assert other.vocab_size == tok.vocab_size  # the vocabulary-size check alone would pass it
    check_prefix(prefix, "--data-path", tok, None)
    message = (f"{prefix} was preprocessed with another tokenizer: {meta_path(prefix)} records "
               f"shakespeare_bpe4096.model with sha256 {meta['tokenizer_sha256'][:16]}..., but --tokenizer-model "
               f"{other_sp_model} has sha256 {tokenizer_fingerprint(other)[:16]}...")
    refused = re.escape(f"--data-path: {message}")
    with pytest.raises(ValueError, match=refused):
        check_prefix(prefix, "--data-path", other, None)
    # tools/evaluate.py nelbo resolves its data through the same path (validation_run -> build_datasets)
    with pytest.raises(ValueError, match=refused):
        validation_run("mdlm", 32, DataConfig(data_path=[prefix], split="90,10,0",
                                              data_cache_path=str(tmp_path / "cache")),
                       TokenizerConfig(SP, other_sp_model), global_batch_size=2, eval_iters=1, seed=1)
    # merge_datasets.py refuses shards made with the two tokenizers
    made_other = preprocess([str(src)], str(tmp_path / "b"), SP, other_sp_model, append_eod=True,
                            **QUIET).output_prefixes["text"]
    r = _tool("merge_datasets.py", "--input", prefix, made_other, "--output-prefix", tmp_path / "m")
    _one_error_line(r, "different tokenizers or settings (tokenizer_sha256 differ)", meta_path(made_other))
    assert not glob.glob(str(tmp_path / "m*"))
    # inspect_dataset.py decodes only with the tokenizer the data was made with
    r = _tool("inspect_dataset.py", prefix, "--tokenizer-type", SP, "--tokenizer-model", other_sp_model)
    _one_error_line(r, f"--tokenizer-model: {message}")
    # an older sidecar without the hash is accepted, as before
    with open(meta_path(prefix), "w") as f:
        json.dump({k: v for k, v in meta.items() if k != "tokenizer_sha256"}, f)
    check_prefix(prefix, "--data-path", other, None)
    # a damaged one is named
    with open(meta_path(prefix), "w") as f:
        f.write('{"vocab_size": 40')
    with pytest.raises(ValueError, match=re.escape(f"{meta_path(prefix)}: not a JSON sidecar")):
        check_prefix(prefix, "--data-path", tok, None)


# ---------------------------------------------------------------- index caches never unpickle


class _Payload:
    """Unpickling it creates a file: proof that a cache ran code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def test_index_caches_holding_objects_are_refused(tmp_path, demo_cache):
    demo = prepare_demo_corpus(demo_cache)
    tok = build_tokenizer(demo["tokenizer_type"], demo["tokenizer_model"])
    cache = str(tmp_path / "cache")
    args = dict(data_path=["0.6", demo["data_prefix"], "0.4", demo["valid_prefix"]], split=None,
                valid_data_path=[demo["valid_prefix"]], seq_length=32, add_extra_token=False, seed=1,
                num_train_samples=64, num_valid_samples=8, cache_path=cache, tokenizer=tok)
    train, _ = build_datasets(**args)
    expected = train[5]
    kinds = ("document_index", "sample_index", "shuffle_index", "dataset_index", "dataset_sample_index")
    marker = str(tmp_path / "code-ran")
    for kind in kinds:
        path = sorted(glob.glob(os.path.join(cache, f"*-train-{kind}.npy")))[0]
        original = open(path, "rb").read()
        for craft in ("object array", "pickle"):
            if craft == "object array":
                np.save(path, np.array([_Payload(marker)], dtype=object), allow_pickle=True)
            else:  # not .npy at all: numpy.load(allow_pickle=True) would hand it to pickle.load
                with open(path, "wb") as f:
                    pickle.dump(_Payload(marker), f)
            crafted = _snapshot(cache)
            with pytest.raises(ValueError, match=rf"index cache {re.escape(path)}: it holds pickled Python "
                                                 r"objects, which are never loaded"):
                build_datasets(**args)
            assert not os.path.exists(marker), f"{kind} ({craft}) ran code"
            assert _snapshot(cache) == crafted  # refused, neither rebuilt nor overwritten
        with open(path, "wb") as f:
            f.write(original)
    np.testing.assert_array_equal(build_datasets(**args)[0][5], expected)


def _torn_reads(save, path: str, seconds: float) -> int:
    """Load `path` over and over for `seconds` while a thread rewrites it with `save`, alternating
    two arrays: how many loads failed or saw neither array whole."""
    arrays = [np.full(4_000_000, i, dtype=np.int64) for i in range(2)]  # 32 MB each
    save(path, arrays[0], allow_pickle=True)
    stop, torn = threading.Event(), 0

    def rewrite():
        i = 1
        while not stop.is_set():
            save(path, arrays[i % 2], allow_pickle=True)
            i += 1

    writer = threading.Thread(target=rewrite)
    writer.start()
    try:
        deadline = time.time() + seconds
        while time.time() < deadline and not torn:
            try:  # not memory-mapped: a file truncated under a mapping would kill this process (SIGBUS)
                loaded = load_index_cache(path)
                torn += loaded.shape != (4_000_000,) or loaded[0] != loaded[-1]
            except (ValueError, EOFError, OSError):
                torn += 1
    finally:
        stop.set()
        writer.join()
    return torn


def test_an_index_cache_being_rewritten_is_read_whole(tmp_path):
    """Jobs sharing a cache directory (a sweep's runs started together) all miss it and all build
    it: megatron-core writes the files in place, so another job could load (or have mapped) one
    mid-write. Through the `numpy` megatron-core's dataset modules see, a reader gets the old
    file or the new one, never a part; the same harness with numpy's in-place save does catch a
    torn read, so the check is not vacuous."""
    from megatron.core.datasets import gpt_dataset

    path = str(tmp_path / "x-sample_index.npy")
    assert _torn_reads(np.save, path, seconds=10) > 0
    assert _torn_reads(gpt_dataset.numpy.save, path, seconds=2) == 0
    assert os.listdir(tmp_path) == ["x-sample_index.npy"]  # no temporaries left behind
