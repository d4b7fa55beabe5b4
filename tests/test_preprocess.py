"""Preprocessing at scale: input formats, tokenizers (tiktoken), sharding, kill/rerun, merge,
inspect/verify. Real text: Shakespeare's plays written by the tests as JSONL, .jsonl.gz,
.jsonl.zst and Parquet."""

import gzip
import json
import os
import signal
import struct
import sys

import numpy as np
import pytest
import torch
from conftest import REPO, launch_env, run_python, tekken_vocab
from interruptions import interrupt_before_publishing, pool_workers

from megatron_dllm.data.indexed_dataset import (
    HEADER_SIZE,
    DatasetFormatError,
    open_indexed_dataset,
    read_metadata,
    validate_indexed_dataset,
)
from megatron_dllm.data.prep import dataset_writer as idxmod
from megatron_dllm.data.prep.dataset_writer import IndexedDatasetWriter
from megatron_dllm.data.prep.demo import shakespeare_files
from megatron_dllm.data.prep.inspect import describe_dataset, verify_dataset
from megatron_dllm.data.prep.merge import check_shard_set, expand_prefixes, merge_datasets, write_blend_file
from megatron_dllm.data.prep.preprocess import preprocess, shard_prefix
from megatron_dllm.data.prep.progress import Progress
from megatron_dllm.data.prep.sources import expand_inputs, shard_files
from megatron_dllm.data.prep.tiktoken_files import write_tiktoken_from_bytelevel
from megatron_dllm.data.tokenizers import TikTokenizer, build_tokenizer
from megatron_dllm.errors import InputError

TOOLS = os.path.join(REPO, "tools")
SP = "SentencePieceTokenizer"


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _same(a, b):
    return all(_read(a + ext) == _read(b + ext) for ext in (".bin", ".idx"))


def _tool(name, *args, env=None):
    return run_python([os.path.join(TOOLS, name), *map(str, args)], REPO, env or launch_env(1), 300)


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def plays():
    """12 plays, each a list of paragraphs (documents)."""
    out = {}
    for f in shakespeare_files()[:12]:
        text = open(f, encoding="utf-8").read()
        out[os.path.basename(f)[:-4]] = [p.strip("\n") for p in text.split("\n\n") if p.strip()]
    return out


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory, plays):
    import sentencepiece as spm

    path = str(tmp_path_factory.mktemp("tok") / "sp.model")
    lines = [line for docs in list(plays.values())[:3] for p in docs for line in p.splitlines() if line.strip()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=path[:-6], vocab_size=1000, model_type="bpe",
        byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, normalization_rule_name="identity",
        remove_extra_whitespaces=False, num_threads=1, minloglevel=2)
    return path


@pytest.fixture(scope="module")
def tiktoken_file(tmp_path_factory, plays):
    """A .tiktoken file converted from a byte-level BPE trained with `tokenizers`: ranks in the
    trainer's id order (merge order), all 256 bytes included."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    docs = [p for d in list(plays.values())[:3] for p in d]
    tok.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=2000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    path = str(tmp_path_factory.mktemp("tik") / "shakespeare.tiktoken")
    write_tiktoken_from_bytelevel(path, tok.get_vocab())
    return path


def _write_formats(directory, docs_by_file, formats=("jsonl", "jsonl.gz", "jsonl.zst", "parquet")):
    """Write the same documents in each format; returns {format: [paths]}."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    out = {}
    for fmt in formats:
        sub = os.path.join(directory, fmt.replace(".", "_"))
        os.makedirs(sub, exist_ok=True)
        out[fmt] = []
        for name, docs in docs_by_file.items():
            path = os.path.join(sub, f"{name}.{fmt}")
            lines = b"".join(json.dumps({"text": d, "id": i}).encode() + b"\n" for i, d in enumerate(docs))
            if fmt == "jsonl":
                open(path, "wb").write(lines)
            elif fmt == "jsonl.gz":
                with gzip.open(path, "wb") as f:
                    f.write(lines)
            elif fmt == "jsonl.zst":
                with open(path, "wb") as raw, zstandard.ZstdCompressor().stream_writer(raw) as w:
                    w.write(lines[: len(lines) // 2])  # two frames
                    w.flush(zstandard.FLUSH_FRAME)
                    w.write(lines[len(lines) // 2:])
            else:
                pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), path, row_group_size=100)
            out[fmt].append(path)
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, plays):
    d = str(tmp_path_factory.mktemp("corpus"))
    return _write_formats(d, plays)


# ---------------------------------------------------------------- formats


def test_formats_give_identical_tokens(tmp_path, corpus, sp_model, plays):
    outs = {}
    for fmt, paths in corpus.items():
        stats = preprocess([os.path.dirname(paths[0]) + "/*"], str(tmp_path / fmt), SP, sp_model,
                           append_eod=True, workers=1, log=lambda m: None)
        outs[fmt] = stats.output_prefixes["text"]
        assert stats.read == sum(map(len, plays.values())) == stats.keys["text"].written
    ref = outs.pop("jsonl")
    for fmt, prefix in outs.items():
        assert _same(ref, prefix), fmt
    # 2 worker processes, small chunks: same bytes
    stats = preprocess(corpus["parquet"], str(tmp_path / "w2"), SP, sp_model, append_eod=True, workers=2,
                       chunksize=37, chunk_bytes=5000, log=lambda m: None)
    assert _same(ref, stats.output_prefixes["text"])
    ds = open_indexed_dataset(ref)
    tok = build_tokenizer(SP, sp_model)
    first = sorted(plays)[0]
    assert tok.detokenize(ds[0][:-1].tolist()) == plays[first][0] and ds[0][-1] == tok.eod
    assert ds.index.dtype == np.uint16


@pytest.mark.parametrize("tokenizer", [SP, "TikTokenizer"])
def test_rejections_named_in_every_format(tmp_path, sp_model, tokenizer):
    """The same records are rejected whatever the tokenizer (Megatron-LM's JSON TikTokenizer would
    write a lone surrogate as U+FFFD, SentencePiece raises on it)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    model, kw = (sp_model, {}) if tokenizer == SP else (tekken_vocab(tmp_path, size=3000),
                                                        dict(tokenizer_options=dict(vocab_size=4000)))
    good = json.dumps({"text": "To be, or not to be"}).encode()
    deep = b'{"text": "nested too deeply to parse", "a": ' + b"[" * 1500 + b"]" * 1500 + b"}"
    lines = [good, b'{"text": "caf\xe9 au lait"}', b'{"text": "unterminated', json.dumps({"body": "x"}).encode(),
             json.dumps({"text": "  \n "}).encode(), json.dumps({"text": None}).encode(),
             json.dumps({"text": 7}).encode(), b"", json.dumps({"text": "\ud800"}).encode(), good, deep]
    (tmp_path / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    msgs = []
    st = preprocess([str(tmp_path / "a.jsonl")], str(tmp_path / "a"), tokenizer, model, log=msgs.append, **kw)
    k = st.keys["text"]
    assert st.read == 10 == k.written + sum(k.rejected.values()) and st.blank_lines == 1
    assert dict(k.rejected) == {"invalid_utf8": 2, "invalid_json": 2, "missing_key": 2, "empty_text": 1,
                                "not_text": 1}
    assert {(pos, r) for _, pos, _, r in st.rejections} == {
        (2, "invalid_utf8"), (3, "invalid_json"), (4, "missing_key"), (5, "empty_text"),
        (6, "missing_key"), (7, "not_text"), (9, "invalid_utf8"), (11, "invalid_json")}
    assert any(m.endswith("a.jsonl:3 [text]: invalid_json") for m in msgs)
    assert any(m.endswith("a.jsonl:11 [text]: invalid_json") for m in msgs)
    assert "a.jsonl\t2\ttext\tinvalid_utf8" in open(st.rejections_files["text"]).read()
    assert "rejected: 8 (empty_text=1, invalid_json=2, invalid_utf8=2" in st.summary()
    # Parquet: null cells, a binary column with bad UTF-8; rows are 1-based
    pq.write_table(pa.table({"text": ["Good morrow", None, "", "Adieu"],
                             "raw": [b"ok", b"\xff\xfe", b"fine", None]}), tmp_path / "b.parquet", row_group_size=2)
    st = preprocess([str(tmp_path / "b.parquet")], str(tmp_path / "b"), tokenizer, model,
                    json_keys=["text", "raw"], log=msgs.append, **kw)
    assert st.read == 4 and st.keys["text"].written == 2 and st.keys["raw"].written == 2
    assert {(pos, key, r) for _, pos, key, r in st.rejections} == {
        (2, "text", "missing_key"), (3, "text", "empty_text"), (2, "raw", "invalid_utf8"),
        (4, "raw", "missing_key")}
    assert any("b.parquet row 2 [raw]: invalid_utf8" in m for m in msgs)
    # a column missing from the schema is refused before tokenizing (tests/test_faults_data.py)
    with pytest.raises(ValueError, match=r"--json-keys absent: .*b.parquet has no column 'absent'; "
                                         r"its columns are \['text', 'raw'\]"):
        preprocess([str(tmp_path / "b.parquet")], str(tmp_path / "c"), tokenizer, model,
                   json_keys=["text", "absent"], log=msgs.append, **kw)


def test_byte_order_mark_is_not_text(tmp_path, sp_model):
    """A file saved as utf-8-sig (as Windows tools write) gives the tokens of the same file without
    the mark: its first JSON line parses, its text does not begin with U+FEFF."""
    docs = ["Good morrow, cousin.", "Adieu."]
    jsonl = "".join(json.dumps({"text": d}) + "\n" for d in docs)
    prefixes = {}
    for name, fmt, content in [("plain", "jsonl", jsonl), ("sig", "jsonl", jsonl),
                               ("plain_txt", "txt", docs[0]), ("sig_txt", "txt", docs[0])]:
        path = tmp_path / f"{name}.{fmt}"
        path.write_text(content, encoding="utf-8-sig" if name.startswith("sig") else "utf-8")
        st = preprocess([str(path)], str(tmp_path / name), SP, sp_model, append_eod=True, log=lambda m: None)
        assert not st.rejections, name
        prefixes[name] = st.output_prefixes["text"]
    assert _same(prefixes["plain"], prefixes["sig"]) and _same(prefixes["plain_txt"], prefixes["sig_txt"])
    assert len(open_indexed_dataset(prefixes["sig"])) == 2


# ---------------------------------------------------------------- sharding, merge


def test_shard_rule_is_contiguous_and_byte_balanced(tmp_path):
    sizes = [5, 100, 1, 1, 50, 50, 0, 300, 7]
    files = []
    for i, s in enumerate(sizes):
        p = tmp_path / f"f{i}.jsonl"
        p.write_bytes(b"x" * s)
        files.append(str(p))
    files = expand_inputs([str(tmp_path / "f*.jsonl"), files[0]])  # sorted, deduplicated
    assert files == sorted(files) and len(files) == len(sizes)
    for n in (1, 2, 3, 4, 12):
        parts = [shard_files(files, n, i) for i in range(n)]
        assert sum(parts, []) == files  # in order: concatenating shards = the full list
    assert [len(shard_files(files, 12, i)) for i in range(12)].count(0) > 0  # empty shards allowed
    with pytest.raises(ValueError, match="--shard-index 3"):
        shard_files(files, 3, 3)


def test_a_file_named_two_ways_is_one_input(tmp_path, monkeypatch):
    """Relative and absolute spellings of one file: read once by preprocessing, refused as listed
    twice where inputs keep their order (SFT), and one dataset listed twice for a merge."""
    monkeypatch.chdir(tmp_path)
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text('{"text": "x"}\n')
    absolute = str(tmp_path / "a.jsonl")
    files = expand_inputs(["a.jsonl", absolute, "./b.jsonl", "b.jsonl"])
    assert list(map(os.path.abspath, files)) == [absolute, str(tmp_path / "b.jsonl")]
    with pytest.raises(ValueError, match=r"--input: .*a\.jsonl is listed twice"):
        expand_inputs(["a.jsonl", "b.jsonl", absolute], in_given_order=True)
    with pytest.raises(ValueError, match="a dataset is listed twice"):
        expand_prefixes(["data/x_text_document", "./data/x_text_document"])



def test_a_double_star_glob_reaches_every_depth(tmp_path, monkeypatch):
    """`--input 'data/**/*.jsonl'` as in the shell's globstar and Python's recursive glob: the files
    at the top and in every nested directory, not only one level down."""
    monkeypatch.chdir(tmp_path)
    for name in ("top.jsonl", "a/mid.jsonl", "a/b/deep.jsonl"):
        os.makedirs(os.path.dirname(tmp_path / "data" / name), exist_ok=True)
        (tmp_path / "data" / name).write_text('{"text": "x"}\n')
    assert expand_inputs(["data/**/*.jsonl"]) == ["data/a/b/deep.jsonl", "data/a/mid.jsonl", "data/top.jsonl"]


def test_sharded_then_merged_equals_single_run(tmp_path, corpus, sp_model):
    inputs = corpus["jsonl.zst"]
    one = preprocess(inputs, str(tmp_path / "one"), SP, sp_model, append_eod=True, log=lambda m: None)
    n, out = 4, str(tmp_path / "sh" / "corpus")
    for i in range(n):
        st = preprocess(inputs, out, SP, sp_model, append_eod=True, num_shards=n, shard_index=i,
                        workers=1 + i % 2, log=lambda m: None)
        assert st.output_prefixes["text"] == shard_prefix(out, i, n) + "_text_document"
        assert os.path.isfile(shard_prefix(out, i, n) + ".done.json")
    msgs = []
    again = preprocess(inputs, out, SP, sp_model, append_eod=True, num_shards=n, shard_index=2, log=msgs.append)
    assert again.skipped and "skipping" in msgs[0] and "already finished" in again.summary()
    r = _tool("merge_datasets.py", "--input", out + "_shard*_text_document", "--output-prefix", tmp_path / "merged")
    assert r.returncode == 0, r.stderr
    assert _same(one.output_prefixes["text"], str(tmp_path / "merged"))
    prefixes = expand_prefixes([out + "_shard*_text_document"])
    with pytest.raises(ValueError, match=r"3 of 4 shards; missing shard indices \[1\]"):
        check_shard_set(prefixes[:1] + prefixes[2:])
    r = _tool("merge_datasets.py", "--input", *prefixes[:2], "--output-prefix", tmp_path / "bad")
    assert r.returncode == 2 and "missing shard indices [2, 3]" in r.stderr
    pairs = write_blend_file(prefixes, str(tmp_path / "blend.txt"))
    from megatron_dllm.data.datasets import parse_data_path

    paths, weights = parse_data_path(open(tmp_path / "blend.txt").read().split())
    assert paths == [os.path.abspath(p) for p in prefixes] and sum(weights) == one.keys["text"].tokens
    assert [w for w, _ in pairs] == weights
    # a changed input: the finished shard that holds it is redone only with overwrite, and shards
    # made before the change do not merge with the one made after it
    last = shard_files(sorted(inputs), n, n - 1)[-1]
    with open(last, "ab") as f:
        import zstandard

        f.write(zstandard.ZstdCompressor().compress(b'{"text": "Exeunt."}\n'))
    with pytest.raises(InputError, match=r"shard00003of00004.done.json: this shard was finished with other inputs, "
                                         r"tokenizer or flags \(inputs, run.inputs.bytes, run.inputs.sha256 differ\); "
                                         r"pass --overwrite"):
        preprocess(inputs, out, SP, sp_model, append_eod=True, num_shards=n, shard_index=n - 1, log=lambda m: None)
    st = preprocess(inputs, out, SP, sp_model, append_eod=True, num_shards=n, shard_index=n - 1, overwrite=True,
                    log=lambda m: None)
    assert not st.skipped
    r = _tool("merge_datasets.py", "--input", out + "_shard*_text_document", "--output-prefix", tmp_path / "mixed")
    assert r.returncode == 2 and "shards of different preprocessing runs" in r.stderr and \
        r.stderr.rstrip().endswith("differ in inputs.bytes, inputs.sha256; redo the mismatched shards with "
                                   "--overwrite, or pass --allow-incomplete to merge anyway"), r.stderr
    assert not os.path.exists(tmp_path / "mixed.idx")


def test_merge_refuses_shards_that_one_run_did_not_make(tmp_path, corpus, sp_model):
    """Each machine of an array must see the same inputs and flags: shards made from another file
    list, or with another --append-eod, would merge into a corpus with documents twice or missing,
    or mixed ends. A shard without its marker did not finish. More shards than files is fine."""
    inputs = sorted(corpus["jsonl"])[:3]
    one = preprocess(inputs, str(tmp_path / "one"), SP, sp_model, log=lambda m: None)

    def shards(name, n, **per_shard):
        out = str(tmp_path / name / "c")
        for i in range(n):
            preprocess(per_shard.get("inputs", {}).get(i, inputs), out, SP, sp_model, num_shards=n, shard_index=i,
                       append_eod=per_shard.get("append_eod", {}).get(i, False), log=lambda m: None)
        return out

    def merge(out):
        return _tool("merge_datasets.py", "--input", out + "_shard*_text_document", "--output-prefix", out + "_merged")

    r = merge(shards("missing_file", 2, inputs={1: inputs[:-1]}))  # one machine lacks the last file
    assert r.returncode == 2 and "differ in inputs.bytes, inputs.files, inputs.sha256" in r.stderr, r.stderr
    r = merge(shards("eod", 2, append_eod={0: True}))
    assert r.returncode == 2 and "differ in append_eod" in r.stderr, r.stderr
    out = shards("unfinished", 2)
    os.remove(shard_prefix(out, 1, 2) + ".done.json")
    r = merge(out)
    assert r.returncode == 2 and f"no {shard_prefix(out, 1, 2)}.done.json, so its shard did not finish" in r.stderr
    many = len(inputs) + 2  # shards without a file write valid empty datasets
    out = shards("many", many)
    stale = out + "_merged.bin.tmp-4194303-dead"  # a merge killed midway left it (no such pid runs)
    open(stale, "wb").write(b"partial")
    r = merge(out)
    assert r.returncode == 0, r.stderr
    assert _same(one.output_prefixes["text"], out + "_merged") and not os.path.exists(stale)
    r = _tool("merge_datasets.py", "--input", out + "_shard*_text_document", "--blend-file", tmp_path / "many.txt")
    from megatron_dllm.data.datasets import parse_data_path

    paths, weights = parse_data_path((tmp_path / "many.txt").read_text().split())  # weights must be positive
    assert r.returncode == 0 and sum(weights) == one.keys["text"].tokens and min(weights) > 0, r.stderr
    assert r.stdout.count("left out of the blend: ") == many - len(paths) > 0
    # shards whose every record was rejected: the merge refuses, as one machine would, not a 0-document corpus
    blank = [tmp_path / f"blank{i}.jsonl" for i in range(2)]
    for path in blank:
        path.write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": "  "}) + "\n")
    for i in range(2):
        preprocess([str(p) for p in blank], str(tmp_path / "blank" / "c"), SP, sp_model, num_shards=2, shard_index=i,
                   log=lambda m: None)
    r = merge(str(tmp_path / "blank" / "c"))
    assert r.returncode == 2 and "error: --input: the 2 datasets hold no tokens" in r.stderr, r.stderr
    assert not os.path.exists(str(tmp_path / "blank" / "c_merged.idx"))

    # a blend file: not written over without overwrite, of datasets of one tokenizer, without spaces
    import shutil

    blend, prefixes = tmp_path / "blend.txt", [one.output_prefixes["text"]]
    blend.write_text("mine\n")
    with pytest.raises(InputError, match=f"--blend-file {blend} already exists; pass --overwrite"):
        write_blend_file(prefixes, str(blend))
    assert blend.read_text() == "mine\n"
    write_blend_file(prefixes, str(blend), overwrite=True)
    (tmp_path / "a b").mkdir()
    for ext in (".bin", ".idx", ".meta.json"):
        shutil.copyfile(one.output_prefixes["text"] + ext, str(tmp_path / "a b" / "c") + ext)
    with pytest.raises(InputError, match="a path with whitespace cannot stand in a --data-path list"):
        write_blend_file([str(tmp_path / "a b" / "c")], str(tmp_path / "b2.txt"))
    shutil.copytree(tmp_path / "a b", tmp_path / "other")
    meta = json.loads((tmp_path / "other" / "c.meta.json").read_text())
    (tmp_path / "other" / "c.meta.json").write_text(json.dumps({**meta, "tokenizer_sha256": "0" * 64}))
    with pytest.raises(InputError, match="made with different tokenizers or settings \\(tokenizer_sha256 differ\\)"):
        write_blend_file([one.output_prefixes["text"], str(tmp_path / "other" / "c")], str(tmp_path / "b3.txt"))
    assert not os.path.exists(tmp_path / "b2.txt") and not os.path.exists(tmp_path / "b3.txt")
    # datasets with and without --append-eod would join documents without a separator; a sidecar
    # written before `append_eod` was recorded still merges with one that records it
    eod = preprocess(inputs[:1], str(tmp_path / "eod"), SP, sp_model, append_eod=True, log=lambda m: None)
    assert read_metadata(eod.output_prefixes["text"])["append_eod"] is True
    r = _tool("merge_datasets.py", "--input", one.output_prefixes["text"], eod.output_prefixes["text"],
              "--output-prefix", tmp_path / "eodmix")
    assert r.returncode == 2 and "different tokenizers or settings (append_eod differ)" in r.stderr, r.stderr
    old = json.loads((tmp_path / "other" / "c.meta.json").read_text())
    del old["append_eod"]
    (tmp_path / "other" / "c.meta.json").write_text(json.dumps({**old, "tokenizer_sha256": meta["tokenizer_sha256"]}))
    r = _tool("merge_datasets.py", "--input", str(tmp_path / "other" / "c"), one.output_prefixes["text"],
              "--output-prefix", tmp_path / "oldnew")
    assert r.returncode == 0 and read_metadata(str(tmp_path / "oldnew"))["append_eod"] is False, r.stderr
    r = _tool("merge_datasets.py", "--input", str(tmp_path / "other" / "c"), one.output_prefixes["text"],
              eod.output_prefixes["text"], "--output-prefix", tmp_path / "oldnewnew")  # the two new ones differ
    assert r.returncode == 2 and "(append_eod differ)" in r.stderr and not os.path.exists(tmp_path / "oldnewnew.bin")


def test_sigkill_mid_run_then_rerun_is_byte_identical(tmp_path, plays, sp_model):
    # 2 copies of the 12 plays, 24 files.
    docs = {f"{k}_{c}": v for c in range(2) for k, v in plays.items()}
    inputs = _write_formats(str(tmp_path / "in"), docs, formats=("jsonl",))["jsonl"]
    ref = str(tmp_path / "ref" / "c")
    for i in range(2):
        preprocess(inputs, ref, SP, sp_model, append_eod=True, num_shards=2, shard_index=i, log=lambda m: None)
    out = str(tmp_path / "run" / "c")
    cmd = ["preprocess_data.py", "--input", str(tmp_path / "in" / "jsonl" / "*.jsonl"), "--output-prefix", out,
           "--tokenizer-type", SP, "--tokenizer-model", sp_model, "--append-eod", "--num-shards", "2",
           "--chunksize", "64"]
    env = {k: v for k, v in launch_env(1).items() if not k.startswith("SLURM_")}
    env["SLURM_ARRAY_TASK_COUNT"], env["SLURM_ARRAY_TASK_ID"] = "2", "0"  # shard 0 via Slurm defaults
    r = _tool(*cmd, env=env)
    assert r.returncode == 0 and "shard 0 of 2" in r.stdout, r.stderr
    final = shard_prefix(out, 1, 2) + "_text_document"

    def started(p, run=tmp_path / "run"):
        """`p` has written tokens to its temporary .bin of shard 1."""
        return any(f".bin.tmp-{p.pid}-" in f and "shard00001" in f and os.path.getsize(run / f) > 0
                   for f in os.listdir(run))

    # 1) SIGKILL one tokenizer worker: the shard fails loudly and leaves no finished file
    argv = [sys.executable, os.path.join(TOOLS, cmd[0]), *cmd[1:], "--shard-index", "1"]
    shard_outputs = [final + ".bin", final + ".idx", shard_prefix(out, 1, 2) + ".done.json"]
    p, err = interrupt_before_publishing([*argv, "--workers", "2"], lambda p: len(pool_workers(p)) >= 2 and started(p),
                                          shard_outputs, lambda p: os.kill(pool_workers(p)[-1].pid, signal.SIGKILL))
    assert p.returncode == 2 and "Traceback" not in err, err[-2000:]
    assert err.splitlines()[-1].startswith("error: a tokenizer worker died (killed, or out of memory"), err[-2000:]
    assert not os.path.exists(final + ".idx")

    # 1b) Ctrl-C, which a terminal sends to the whole process group (workers too): one line, exit 130.
    # Its own input, forty copies of the plays, so that few runs finish before they are stopped.
    copies = {f"{k}_{c}": v for c in range(40) for k, v in plays.items()}
    _write_formats(str(tmp_path / "in_1b"), copies, formats=("jsonl",))
    (tmp_path / "run_1b").mkdir()
    flags = [str(tmp_path / "in_1b" / "jsonl" / "*.jsonl") if a == cmd[2] else a for a in cmd[1:]]
    flags[flags.index("--output-prefix") + 1] = str(tmp_path / "run_1b" / "c")
    final_1b = shard_prefix(str(tmp_path / "run_1b" / "c"), 1, 2)
    p, err = interrupt_before_publishing(
        [sys.executable, os.path.join(TOOLS, cmd[0]), *flags, "--shard-index", "1", "--workers", "2"],
        lambda p: started(p, tmp_path / "run_1b"),
        [final_1b + "_text_document.bin", final_1b + "_text_document.idx", final_1b + ".done.json"],
        lambda p: os.killpg(p.pid, signal.SIGINT))
    assert p.returncode == 130 and err.splitlines()[-1] == "interrupted" and "Traceback" not in err, err[-3000:]
    assert not [f for f in os.listdir(tmp_path / "run_1b") if f.endswith(".idx")]

    # 2) SIGKILL the whole shard process mid-run: only temporaries remain
    p, _ = interrupt_before_publishing(argv, started, shard_outputs, lambda p: p.send_signal(signal.SIGKILL))
    assert not os.path.exists(final + ".idx") and not os.path.exists(final + ".bin") and started(p)
    assert not os.path.exists(shard_prefix(out, 1, 2) + ".done.json")
    with pytest.raises(DatasetFormatError):
        validate_indexed_dataset(final)

    # 3) rerun the whole array: shard 0 skipped, shard 1 redone; equal to the uninterrupted run
    for i in range(2):
        r = _tool(*cmd, "--shard-index", i)
        assert r.returncode == 0, r.stderr
        assert ("already finished" in r.stdout) == (i == 0)
    assert "temporary files of an interrupted run" in r.stderr
    for i in range(2):
        assert _same(shard_prefix(ref, i, 2) + "_text_document", shard_prefix(out, i, 2) + "_text_document")
    assert not [f for f in os.listdir(tmp_path / "run") if ".tmp-" in f]


# ---------------------------------------------------------------- merge/inspect megatron-built data


@pytest.mark.slow
def test_megatron_built_dataset_merges_and_inspects(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    parts = []
    for k in range(3):  # documents of several sequences (sentence mode), int32
        prefix = str(tmp_path / f"m{k}")
        b = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
        for _ in range(20 + k):
            lens = rng.integers(1, 30, size=rng.integers(1, 4)).tolist()
            b.add_document(torch.tensor(rng.integers(0, 70000, size=sum(lens))), lens)
        b.finalize(prefix + ".idx")
        parts.append(prefix)
    ref = str(tmp_path / "ref")  # megatron-core's own merge
    b = IndexedDatasetBuilder(ref + ".bin", dtype=np.int32)
    for p in parts:
        b.add_index(p)
    b.finalize(ref + ".idx")
    stats = merge_datasets(parts, str(tmp_path / "ours"))
    assert _same(ref, str(tmp_path / "ours")) and stats.documents == 63
    rep = describe_dataset(str(tmp_path / "ours"), samples=2, sample_tokens=5)
    assert rep.documents == 63 and rep.sequences > 63 and rep.dtype == "int32"
    assert sum(c for _, _, c in rep.histogram) == 63 and rep.samples[0]["document"] == 0
    r = _tool("inspect_dataset.py", tmp_path / "ours", "--verify", "--samples", "1")
    assert r.returncode == 0 and "documents 63" in r.stdout and "verify: OK" in r.stdout, r.stderr
    r = _tool("inspect_dataset.py", tmp_path / "ours", "--verify", "--vocab-size", "1000")
    assert r.returncode == 2 and "outside the vocabulary [0, 1000)" in r.stderr


def test_inspect_sums_each_documents_sequences_when_there_are_as_many_of_both(tmp_path):
    """Megatron-LM writes an empty document for an empty text and a sequence per list item: 3
    documents of 3, 0 and 5 tokens in 3 sequences [3], [], [2, 3], not one sequence each."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "m")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for lengths in ([3], [], [2, 3]):
        builder.add_document(torch.arange(sum(lengths), dtype=torch.int32), lengths)
    builder.finalize(prefix + ".idx")
    rep = describe_dataset(prefix, samples=0)
    assert (rep.sequences, rep.documents) == (3, 3)
    assert (rep.min_length, rep.max_length, rep.mean_length) == (0, 5, 8 / 3)
    assert rep.histogram == [(0, 1, 1), (1, 2, 0), (2, 4, 1), (4, 8, 1)]


def test_verify_reports_first_inconsistency_offset(tmp_path, sp_model):
    prefix = str(tmp_path / "d")
    docs = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], [11, 12]]
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for d in docs:
            w.add_document(d)
    good = _read(prefix + ".idx")
    s = len(docs)
    off_len, off_ptr, off_doc = HEADER_SIZE, HEADER_SIZE + 4 * s, HEADER_SIZE + 12 * s

    def corrupt(offset, data):
        raw = bytearray(good)
        raw[offset: offset + len(data)] = data
        open(prefix + ".idx", "wb").write(bytes(raw))

    cases = [
        (off_ptr + 8 * 3, struct.pack("<q", 10), f"at byte offset {off_ptr + 24}: sequence 3 points to byte 10"),
        (off_len + 4 * 1, struct.pack("<i", 3), f"at byte offset {off_len + 4}: sequence 1 has length 3"),
        (off_len + 4 * 2, struct.pack("<i", -1), f"at byte offset {off_len + 8}: sequence 2 has negative length"),
        (off_doc + 8 * 2, struct.pack("<q", 0), f"at byte offset {off_doc + 16}: document_indices decrease"),
    ]
    for offset, data, expected in cases:
        corrupt(offset, data)
        with pytest.raises(DatasetFormatError) as err:
            verify_dataset(prefix)
        assert expected in str(err.value), str(err.value)
        r = _tool("inspect_dataset.py", prefix, "--verify")
        assert r.returncode == 2 and expected in r.stderr
    open(prefix + ".idx", "wb").write(good)
    raw = bytearray(_read(prefix + ".bin"))
    raw[2 * 7: 2 * 8] = struct.pack("<H", 5000)  # token 7 (in sequence 3) out of a 4097 vocabulary
    open(prefix + ".bin", "wb").write(bytes(raw))
    with pytest.raises(DatasetFormatError, match=r"d.bin at byte offset 14: token 7 \(in sequence 3\) is 5000"):
        verify_dataset(prefix, vocab_size=4097)
    # showing it decoded (no --verify) names the id the tokenizer cannot decode, not a traceback
    r = _tool("inspect_dataset.py", prefix + ".bin", "--tokenizer-type", SP, "--tokenizer-model", sp_model,
              "--samples", "5")
    vocab = build_tokenizer(SP, sp_model).vocab_size
    assert r.returncode == 2 and r.stderr == (f"error: {prefix}: document 3 holds token id 5000, outside the "
                                              f"tokenizer's vocabulary of {vocab}; --verify checks every token\n")


def test_writer_spills_lengths_byte_identical(tmp_path, monkeypatch):
    docs = [list(range(i % 13 + 1)) for i in range(100)]
    with IndexedDatasetWriter(str(tmp_path / "a"), np.uint16) as w:
        for d in docs:
            w.add_document(d)
    monkeypatch.setattr(idxmod, "_SPILL", 7)
    monkeypatch.setattr(idxmod, "_CHUNK", 5)
    with IndexedDatasetWriter(str(tmp_path / "b"), np.uint16) as w:
        for d in docs[:50]:
            w.add_document(d)
        w.add_documents(np.concatenate(docs[50:]), [len(d) for d in docs[50:]])
        assert os.path.exists(w._tmp_lengths) and w.num_documents == 100
    assert _same(str(tmp_path / "a"), str(tmp_path / "b"))
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "a.idx", "b.bin", "b.idx"]


# ---------------------------------------------------------------- tiktoken


@pytest.mark.slow
def test_tiktoken_round_trip_and_preprocess(tmp_path, tiktoken_file, plays, corpus):
    tok = build_tokenizer("TikTokenizer", tiktoken_file)
    n = len(TikTokenizer.load_ranks(tiktoken_file))
    assert (tok.bos, tok.eod, tok.mask_id, tok.vocab_size) == (n, n + 1, n + 2, n + 3)
    text = "\n\n".join(plays[sorted(plays)[-1]][:200]) + "\nÀ bientôt — 123456 ✓ <|end_of_text|>"
    ids = tok.tokenize(text)
    assert tok.detokenize(ids[:10] + [tok.mask_id] + ids[10:]) == text
    assert len(ids) < len(text.encode()) / 2 and tok.eod not in ids  # real merges; specials are text
    for pattern in ("cl100k", "o200k", r"\S+|\s+"):
        t = build_tokenizer("TikTokenizer", tiktoken_file, pattern=pattern)
        assert t.detokenize(t.tokenize(text)) == text
    big = build_tokenizer("TikTokenizer", tiktoken_file, num_special_tokens=256)
    assert big.vocab_size == n + 257 and big.eod == n + 1
    st = preprocess(corpus["jsonl"][:2], str(tmp_path / "tik"), "TikTokenizer", tiktoken_file, append_eod=True,
                    workers=2, log=lambda m: None)
    ds = open_indexed_dataset(st.output_prefixes["text"])
    first = plays[sorted(plays)[0]]
    assert tok.detokenize(ds[0][:-1].tolist()) == first[0] and ds[0][-1] == tok.eod
    r = _tool("inspect_dataset.py", st.output_prefixes["text"], "--verify", "--tokenizer-type", "TikTokenizer",
              "--tokenizer-model", tiktoken_file, "--samples", "1", "--sample-tokens", "8")
    assert r.returncode == 0 and "verify: OK" in r.stdout and first[0][:5] in r.stdout, r.stderr
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("QQ== 0\nnot-base64!! 1\n")
    with pytest.raises(ValueError, match="line 2 is not `base64token rank`"):
        build_tokenizer("TikTokenizer", str(bad))
    bad.write_text("QQ== 0\n")
    with pytest.raises(ValueError, match="single bytes have no rank"):
        build_tokenizer("TikTokenizer", str(bad))


# ---------------------------------------------------------------- progress and CLI


def test_progress_display_and_log_lines(capsys):
    lines = []
    p = Progress(1000, lines.append, tty=False, log_interval=0.0, label="[shard 1/4] ")
    p.update(10, 500, 250)
    assert "25.0%" in lines[0] and "tokens/s" in lines[0] and "ETA" in lines[0] and lines[0].startswith("[shard")
    p = Progress(1000, lines.append, tty=True)
    p.interval = 0.0
    p.update(1, 2, 500)
    p.close()
    err = capsys.readouterr().err
    assert "\r" in err and "50.0%" in err and "ETA" in err and err.endswith("\n")


def test_cli_flags_and_errors(tmp_path, corpus, sp_model):
    r = _tool("preprocess_data.py", "--input", tmp_path / "none*.jsonl", "--output-prefix", tmp_path / "x",
              "--tokenizer-type", SP, "--tokenizer-model", sp_model)
    assert r.returncode == 2 and f"--input '{tmp_path / 'none*.jsonl'}': no file matches" in r.stderr
    r = _tool("preprocess_data.py", "--input", tmp_path, "--output-prefix", tmp_path / "x",
              "--tokenizer-type", SP, "--tokenizer-model", sp_model)
    assert r.returncode == 2 and f"--input '{tmp_path}': a directory, not a file" in r.stderr
    r = _tool("preprocess_data.py", "--input", corpus["jsonl"][0], "--output-prefix", tmp_path / "x",
              "--tokenizer-type", SP, "--tokenizer-model", sp_model, "--tiktoken-pattern", "o200k")
    assert r.returncode == 2 and "TikTokenizer only" in r.stderr
    r = _tool("preprocess_data.py", "--input", corpus["jsonl"][0], "--output-prefix", tmp_path / "x",
              "--tokenizer-type", SP, "--tokenizer-model", sp_model, "--shard-index", "1")
    assert r.returncode == 2 and "needs --num-shards" in r.stderr
    r = _tool("preprocess_data.py", "--input", corpus["parquet"][0], "--output-prefix", tmp_path / "x",
              "--tokenizer-type", SP, "--tokenizer-model", sp_model, "--log-interval", "0", "--json-keys", "text")
    assert r.returncode == 0 and "ETA" in r.stderr and "tokens/s" in r.stdout
