"""Data layer: .bin/.idx format, validation, tokenizers, preprocessing, demo corpus, datasets."""

import json
import os
import re
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO

from megatron_dllm.data.datasets import build_datasets, check_prefix, parse_data_path
from megatron_dllm.data.indexed_dataset import (
    DatasetFormatError,
    max_token_id,
    open_indexed_dataset,
    optimal_dtype,
    validate_indexed_dataset,
)
from megatron_dllm.data.prep.dataset_writer import IndexedDatasetWriter
from megatron_dllm.data.prep.demo import prepare_demo_corpus, shakespeare_files
from megatron_dllm.data.prep.preprocess import preprocess
from megatron_dllm.data.tokenizers import build_tokenizer
from megatron_dllm.errors import InputError

# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def demo(demo_cache):
    return prepare_demo_corpus(demo_cache)  # prepared once per run (conftest): here its description


@pytest.fixture(scope="session")
def sp_tok(demo):
    return build_tokenizer(demo["tokenizer_type"], demo["tokenizer_model"])


@pytest.fixture(scope="session")
def plays():
    files = shakespeare_files()
    return {os.path.basename(f): open(f, encoding="utf-8").read() for f in files[:3]}


@pytest.fixture(scope="session")
def paragraphs(plays):
    text = next(iter(plays.values()))
    return [p.strip() for p in text.split("\n\n") if p.strip()][:200]


def _random_docs(n=50, vocab=3000, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=rng.integers(1, 200)).tolist() for _ in range(n)]


def _write_ours(prefix, docs, dtype):
    with IndexedDatasetWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(d)


def _write_megatron(prefix, docs, dtype):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for d in docs:
        b.add_document(torch.tensor(d), [len(d)])
    b.finalize(prefix + ".idx")


# ---------------------------------------------------------------- format


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_writer_matches_megatron_byte_for_byte(tmp_path, dtype):
    docs = _random_docs()
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    _write_ours(ours, docs, dtype)
    _write_megatron(theirs, docs, dtype)
    for ext in (".idx", ".bin"):
        assert open(ours + ext, "rb").read() == open(theirs + ext, "rb").read()
    ds = open_indexed_dataset(ours)  # megatron-core's reader
    assert len(ds) == len(docs)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], np.array(d, dtype=dtype))
    header = validate_indexed_dataset(theirs)
    assert header.num_documents == len(docs) and header.num_tokens == sum(map(len, docs))


def test_optimal_dtype():
    assert optimal_dtype(32001) is np.uint16 and optimal_dtype(65499) is np.uint16
    assert optimal_dtype(65500) is np.int32 and optimal_dtype(128256) is np.int32


def test_writer_is_atomic_and_checks_range(tmp_path):
    prefix = str(tmp_path / "d")
    w = IndexedDatasetWriter(prefix, np.uint16)
    w.add_document([1, 2, 3])
    assert not os.path.exists(prefix + ".bin") and not os.path.exists(prefix + ".idx")
    with pytest.raises(ValueError, match="does not fit"):
        w.add_document([70000])
    w.abort()
    assert os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(prefix, np.uint16) as w:
            w.add_document([1])
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []


def _corrupt(prefix, ext, offset=None, data=None, truncate=None):
    path = prefix + ext
    raw = bytearray(open(path, "rb").read())
    if data is not None:
        raw[offset : offset + len(data)] = data
    if truncate is not None:
        raw = raw[:truncate]
    open(path, "wb").write(bytes(raw))
    return path


@pytest.mark.parametrize(
    "case, ext, kwargs, expected",
    [
        ("bad_magic", ".idx", dict(offset=0, data=b"XXXXXXX"), "bad magic"),
        ("bad_version", ".idx", dict(offset=9, data=struct.pack("<Q", 2)), "bad version 2"),
        ("bad_dtype", ".idx", dict(offset=17, data=bytes([9])), "unknown dtype code 9"),
        ("short_header", ".idx", dict(truncate=20), "truncated"),
        ("short_idx", ".idx", dict(truncate=100), "truncated"),
        ("short_bin", ".bin", dict(truncate=50), "truncated"),
        ("long_bin", ".bin", dict(offset=10**6, data=b"\0\0"), "do not belong together"),
    ],
)
def test_malformed_files_raise_naming_file(tmp_path, case, ext, kwargs, expected):
    prefix = str(tmp_path / case)
    _write_ours(prefix, _random_docs(10), np.uint16)
    path = _corrupt(prefix, ext, **kwargs)
    with pytest.raises(DatasetFormatError, match=expected) as err:
        validate_indexed_dataset(prefix)
    assert path in str(err.value) and "byte offset" in str(err.value)


@pytest.mark.parametrize("command", ["merge_datasets", "build_indexes"])
def test_a_malformed_dataset_is_one_error_line_from_the_commands_that_read_it(tmp_path, capsys, sp_model, command):
    import importlib

    prefix = str(tmp_path / "d_text_document")
    _write_ours(prefix, _random_docs(10, vocab=4000), np.uint16)
    path = _corrupt(prefix, ".bin", truncate=50)
    main = importlib.import_module(f"megatron_dllm.cli.{command}").main
    argv = (["--input", prefix, "--output-prefix", str(tmp_path / "merged")] if command == "merge_datasets" else
            ["--preset", "cpu-micro", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
             "--train-iters", "2", "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model,
             "--data-path", prefix])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {path} at byte offset 50: ") and "truncated" in err and "\n" not in err


def test_missing_file_raises(tmp_path):
    prefix = str(tmp_path / "d")
    _write_ours(prefix, _random_docs(3), np.uint16)
    os.remove(prefix + ".bin")
    with pytest.raises(DatasetFormatError, match="d.bin: file not found"):
        validate_indexed_dataset(prefix)


def test_max_token_id_is_cached_by_size_and_mtime(tmp_path):
    prefix, cache = str(tmp_path / "d"), str(tmp_path / "cache")
    _write_ours(prefix, [[5, 9, 1], [7]], np.uint16)
    assert max_token_id(prefix, cache) == 9
    (sidecar,) = os.listdir(cache)
    assert json.load(open(os.path.join(cache, sidecar)))["max"] == 9
    _write_ours(prefix, [[5, 900, 1]], np.uint16)  # rewritten: size changes, cache is stale
    assert max_token_id(prefix, cache) == 900
    assert max_token_id(prefix) == 900


# ---------------------------------------------------------------- tokenizers


def test_sentencepiece_appends_mask(sp_tok):
    assert (sp_tok.vocab_size, sp_tok.mask_id, sp_tok.eod, sp_tok.bos) == (4097, 4096, 2, 1)
    ids = sp_tok.tokenize("Shall I compare thee to a summer's day?\nThou art")
    assert sp_tok.bos not in ids and sp_tok.eod not in ids
    assert sp_tok.detokenize(ids[:3] + [sp_tok.mask_id] + ids[3:]) == (
        "Shall I compare thee to a summer's day?\nThou art")


def test_sentencepiece_existing_mask(tmp_path, paragraphs, capsys):
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(paragraphs), model_prefix=str(tmp_path / "m"), vocab_size=300,
        user_defined_symbols=["<mask>"], model_type="bpe", num_threads=1, minloglevel=2)
    tok = build_tokenizer("SentencePieceTokenizer", str(tmp_path / "m.model"))
    assert tok.vocab_size == 300 and tok.mask_id == 3 and not tok.mask_appended
    # text that spells the mask piece encodes to the [MASK] id: no diffusion model can learn to
    # predict it (its logit is excluded, the target's log-probability -inf), so such a document is
    # rejected by name when preprocessed, and a dataset that holds the id is refused for training
    assert tok.mask_id in tok.tokenize("see <mask> here")
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "see <mask> here"}) + "\n"
                                         + json.dumps({"text": paragraphs[0]}) + "\n")
    stats = preprocess([str(tmp_path / "docs.jsonl")], str(tmp_path / "out"), "SentencePieceTokenizer",
                       str(tmp_path / "m.model"), append_eod=True, log=lambda m: None)
    assert [(pos, reason) for _, pos, _, reason in stats.rejections] == [(1, "mask_token")]
    check_prefix(stats.output_prefixes["text"], "--data-path", tok, str(tmp_path / "cache"))  # accepted
    _write_ours(str(tmp_path / "masked"), [[5, 6, tok.mask_id, 7], [tok.mask_id, 2]], np.uint16)  # another tool's
    with pytest.raises(InputError, match=r"--data-path: .*masked.bin holds the tokenizer's \[MASK\] id 3 2 times"):
        check_prefix(str(tmp_path / "masked"), "--data-path", tok, str(tmp_path / "cache"))
    # the other tools that write or verify a dataset follow the same rule, naming the first offset
    from megatron_dllm.cli.convert_dataset import main as convert_main
    from megatron_dllm.cli.inspect_dataset import main as inspect_main

    spm_flags = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(tmp_path / "m.model")]
    assert inspect_main([str(tmp_path / "masked"), "--verify"] + spm_flags) == 2
    assert inspect_main([str(tmp_path / "masked"), "--verify", "--vocab-size", "300"] + spm_flags) == 2  # still
    litpkds = tmp_path / "packed.bin"
    litpkds.write_bytes(b"LITPKDS" + struct.pack("<Q", 1) + bytes([8]) + struct.pack("<Q", 4)
                        + np.array([5, 6, tok.mask_id, tok.eod], np.uint16).tobytes())
    assert convert_main(["--from", "litpkds", str(litpkds), "--output-prefix", str(tmp_path / "conv")] + spm_flags) == 2
    err = capsys.readouterr().err
    assert "masked.bin at byte offset 4: token 2 (in sequence 0) is 3, the tokenizer's [MASK] id" in err, err
    assert "packed.bin at byte offset 28: token id 3, expected 0 <= id < 300, id != 3" in err, err
    assert not os.path.exists(tmp_path / "conv.bin")


def _hf_tokenizer_json(path, lines, specials):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=400, special_tokens=specials))
    tok.save(path)


def test_huggingface_tokenizer(tmp_path, paragraphs):
    _hf_tokenizer_json(str(tmp_path / "tokenizer.json"), paragraphs, ["<unk>", "<s>", "</s>"])
    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path))  # directory form
    n = tok.vocab_size - 1
    assert tok.mask_id == n and tok.mask_appended and tok.eod == 2 and tok.bos == 1
    text = "Now is the winter of our discontent\nMade glorious summer"
    assert tok.detokenize(tok.tokenize(text) + [tok.mask_id]) == text
    os.makedirs(tmp_path / "m")
    _hf_tokenizer_json(str(tmp_path / "m" / "tokenizer.json"), paragraphs, ["<unk>", "</s>", "[MASK]"])
    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "m" / "tokenizer.json"))
    assert tok.mask_id == 2 and not tok.mask_appended and tok.eod == 1 and tok.bos is None


@pytest.mark.parametrize("key", ["eos_token", "bos_token"])
def test_a_configured_special_token_missing_from_the_vocabulary_is_refused_not_guessed(tmp_path, paragraphs, key):
    # transformers would give "<|eot|>" a new id: the one we append as [MASK]; falling back to </s> as EOD
    # would end documents with a token the config does not name
    _hf_tokenizer_json(str(tmp_path / "tokenizer.json"), paragraphs[:50], ["<unk>", "<s>", "</s>"])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({key: "<|eot|>"}))
    with pytest.raises(InputError, match=f"tokenizer.json.*tokenizer_config.json {key} '<.eot.>' is not in the "
                                         f"vocabulary"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({key: {"content": "</s>"}}))
    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path))
    assert (tok.bos if key == "bos_token" else tok.eod) == 2


def test_tokenizer_errors_name_flags(tmp_path):
    with pytest.raises(ValueError, match="--tokenizer-type 'GPT3'"):
        build_tokenizer("GPT3", "x")
    with pytest.raises(ValueError, match="--tokenizer-model .*missing.model.*: no such file, expected a SentencePiece"):
        build_tokenizer("SentencePieceTokenizer", str(tmp_path / "missing.model"))
    with pytest.raises(ValueError, match="--tokenizer-model .*: a directory, not a file, expected a SentencePiece"):
        build_tokenizer("SentencePieceTokenizer", str(tmp_path))
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="--tokenizer-model .*junk.model.*not a loadable"):
        build_tokenizer("SentencePieceTokenizer", str(tmp_path / "junk.model"))
    with pytest.raises(ValueError, match="--tokenizer-model .*tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path))


@pytest.mark.parametrize("content, message", [
    (b'{"eos_token": "</s>",\n', r"not valid JSON \(Expecting property name enclosed in double quotes at line 2"),
    (b'["</s>"]', "expected a JSON object of settings, found list"),
    (b"\xff\xfe{}", r":1: not UTF-8 text \(byte 0 is 0xff\)"),
    (b'{"eos_token": ["</s>"]}', r"eos_token \['</s>'\], expected a token string"),
])
def test_a_bad_tokenizer_config_json_is_one_error_naming_it(tmp_path, paragraphs, content, message):
    _hf_tokenizer_json(str(tmp_path / "tokenizer.json"), paragraphs[:50], ["<unk>", "<s>", "</s>"])
    (tmp_path / "tokenizer_config.json").write_bytes(content)
    config = re.escape(f"--tokenizer-model {tmp_path / 'tokenizer_config.json'}")
    with pytest.raises(InputError, match=f"^{config}.*{message}"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path))


# ---------------------------------------------------------------- preprocessing


@pytest.fixture()
def jsonl_corpus(tmp_path, paragraphs):
    path = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"text": p, "id": i}) for i, p in enumerate(paragraphs[:60])]
    lines[5] = '{"text": "truncated'  # invalid JSON          -> line 6
    lines[10] = json.dumps({"body": "no text key"})  # missing key -> line 11
    lines[20] = json.dumps({"text": "   "})  # empty text                -> line 21
    lines[30] = json.dumps({"text": 42})  # not text                      -> line 31
    lines[40] = json.dumps({"text": ["O Romeo, ", "Romeo!"]})  # list of strings is fine
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_preprocess_counts_and_names_rejections(tmp_path, jsonl_corpus, demo, sp_tok):
    messages = []
    stats = preprocess([jsonl_corpus], str(tmp_path / "out"), demo["tokenizer_type"],
                       demo["tokenizer_model"], append_eod=True, log=messages.append)
    key = stats.keys["text"]
    assert stats.read == 60 == key.written + sum(key.rejected.values())
    assert dict(key.rejected) == {"invalid_json": 1, "missing_key": 1, "empty_text": 1, "not_text": 1}
    assert {(line, reason) for _, line, _, reason in stats.rejections} == {
        (6, "invalid_json"), (11, "missing_key"), (21, "empty_text"), (31, "not_text")}
    assert any(f"{jsonl_corpus}:6" in m for m in messages)
    assert "corpus.jsonl\t21\ttext\tempty_text" in open(stats.rejections_files["text"]).read()
    assert "rejected: 4" in stats.summary() and f"tokens written: {key.tokens}" in stats.summary()
    ds = open_indexed_dataset(stats.output_prefixes["text"])
    assert len(ds) == key.written and sum(len(ds[i]) for i in range(len(ds))) == key.tokens
    assert all(ds[i][-1] == sp_tok.eod for i in range(len(ds)))
    assert ds.index.dtype == np.uint16


def test_a_list_valued_field_keeps_its_whitespace_items_as_megatron_lm(tmp_path, demo, sp_tok):
    """Megatron-LM's encoder tokenizes every item of a list and keeps each that gives a token: a
    paragraph break between two pieces is part of the document."""
    pieces = ["First piece.", "\n\n", " ", "Second piece."]
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": pieces}) + "\n" + json.dumps({"text": [" ", "\n"]}) + "\n")
    stats = preprocess([str(tmp_path / "c.jsonl")], str(tmp_path / "out"), demo["tokenizer_type"],
                       demo["tokenizer_model"], append_eod=True)
    assert dict(stats.keys["text"].rejected) == {"empty_text": 1}  # all whitespace: empty, as a plain string
    expected = [i for piece in pieces for i in sp_tok.tokenize(piece)] + [sp_tok.eod]
    assert len(expected) > len(sp_tok.tokenize("First piece.") + sp_tok.tokenize("Second piece.")) + 1
    dataset = open_indexed_dataset(stats.output_prefixes["text"])  # held: its samples view its mmap
    assert dataset[0].tolist() == expected


def test_preprocess_cli_workers_and_plain_text(tmp_path, jsonl_corpus, demo, paragraphs):
    txt = tmp_path / "plays.txt"
    txt.write_text("\n\n".join(paragraphs[:30]) + "\n\n  \n\n" + paragraphs[30] + "\n", encoding="utf-8")
    outputs = {}
    for workers in (1, 2):
        out = str(tmp_path / f"w{workers}")
        run = subprocess.run(
            [sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), "--input",
             jsonl_corpus, str(tmp_path / "*.txt"), "--output-prefix", out,
             "--tokenizer-type", demo["tokenizer_type"], "--tokenizer-model", demo["tokenizer_model"],
             "--append-eod", "--workers", str(workers)],
            capture_output=True, text=True, cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": ""})
        assert run.returncode == 0, run.stderr
        assert "documents read: 91" in run.stdout and "written: 87, rejected: 4" in run.stdout
        outputs[workers] = open(out + "_text_document.bin", "rb").read()
    assert outputs[1] == outputs[2]


# ---------------------------------------------------------------- demo corpus


def test_demo_corpus(demo, sp_tok):
    train, valid = open_indexed_dataset(demo["data_prefix"]), open_indexed_dataset(demo["valid_prefix"])
    assert len(train) >= 40 and len(valid) >= 1
    assert max_token_id(demo["data_prefix"]) < sp_tok.mask_id
    assert sp_tok.detokenize(valid[0][:200]).strip()
    assert prepare_demo_corpus(os.path.dirname(demo["data_prefix"])) == demo  # cached


def _prepare_in_subprocess(cache_dir):
    code = (f"import json; from megatron_dllm.data.prep.demo import prepare_demo_corpus; "
            f"print(json.dumps(prepare_demo_corpus({cache_dir!r})))")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)


@pytest.mark.slow
def test_demo_concurrent_and_interrupted(tmp_path):
    cache = str(tmp_path / "demo")
    procs = [_prepare_in_subprocess(cache) for _ in range(2)]
    results = [p.communicate() for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    assert json.loads(results[0][0]) == json.loads(results[1][0])
    assert sum("prepared in" in err for _, err in results) == 1  # prepared once
    model = open(os.path.join(cache, "shakespeare_bpe4096.model"), "rb").read()
    os.remove(os.path.join(cache, "COMPLETE"))  # as if interrupted before the marker
    prepare_demo_corpus(cache)
    assert open(os.path.join(cache, "shakespeare_bpe4096.model"), "rb").read() == model  # deterministic


# ---------------------------------------------------------------- datasets


def test_parse_data_path():
    assert parse_data_path(["a"]) == (["a"], None)
    assert parse_data_path(["a", "b"]) == (["a", "b"], None)
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    with pytest.raises(InputError, match=r"^--data-path: 3 items, starting with the weight 0.5: a weighted blend is "
                                         r"pairs of weight and prefix$"):
        parse_data_path(["0.5", "a", "0.5"])


@pytest.mark.parametrize("add_extra_token", [True, False])
def test_datasets_lengths_and_determinism(tmp_path, demo, sp_tok, add_extra_token):
    args = dict(data_path=[demo["data_prefix"]], split="969,30,1", valid_data_path=[demo["valid_prefix"]],
                seq_length=64, add_extra_token=add_extra_token, num_train_samples=500,
                num_valid_samples=20, tokenizer=sp_tok)
    train, valid = build_datasets(seed=7, cache_path=str(tmp_path / "c1"), **args)
    again, _ = build_datasets(seed=7, cache_path=str(tmp_path / "c2"), **args)
    other, _ = build_datasets(seed=8, cache_path=str(tmp_path / "c1"), **args)
    n = 64 + int(add_extra_token)
    assert len(train) >= 500 and len(valid) >= 20
    for i in (0, 1, 499):
        s = train[i]
        assert s.dtype == np.int64 and s.shape == (n,) and s.max() < sp_tok.mask_id
        np.testing.assert_array_equal(s, again[i])
    assert valid[0].shape == (n,)
    assert any(not np.array_equal(train[i], other[i]) for i in range(5))


def test_an_index_cache_that_cannot_be_written_is_one_error_naming_the_flag(tmp_path, demo, sp_tok):
    """megatron-core re-raises the OSError of a failed index write as a bare Exception (a traceback);
    here a directory stands where an index file goes (what a read-only cache is to a non-root user)."""
    args = dict(data_path=[demo["data_prefix"]], split="969,30,1", valid_data_path=None, seq_length=32,
                add_extra_token=False, seed=1, num_train_samples=50, num_valid_samples=5, tokenizer=sp_tok)
    build_datasets(cache_path=str(tmp_path / "c1"), **args)
    blocked = tmp_path / "c2"
    shutil.copytree(tmp_path / "c1" / "token_ranges", blocked / "token_ranges")  # the prefix scan is there
    for name in os.listdir(tmp_path / "c1"):
        if name.endswith("-description.txt"):
            (blocked / name).mkdir()
    with pytest.raises(InputError, match=rf"^--data-cache-path {blocked}: Is a directory \({blocked}/.*-description"
                                         rf"\.txt\); the run writes the datasets' index files there"):
        build_datasets(cache_path=str(blocked), **args)
    (tmp_path / "file").write_text("")
    with pytest.raises(InputError, match=rf"^--data-cache-path {tmp_path}/file/cache: Not a directory"):
        build_datasets(cache_path=str(tmp_path / "file" / "cache"), **args)


def test_datasets_split_blend_and_shared_cache(tmp_path, demo, sp_tok):
    cache = str(tmp_path / "cache")
    common = dict(data_path=["0.7", demo["data_prefix"], "0.3", demo["data_prefix"]],
                  split="90,10,0", valid_data_path=None, seq_length=32, seed=1,
                  num_train_samples=300, num_valid_samples=30, cache_path=cache, tokenizer=sp_tok)
    ar_train, ar_valid = build_datasets(add_extra_token=True, **common)
    dl_train, dl_valid = build_datasets(add_extra_token=False, **common)  # same cache dir
    assert len(ar_train) == 300 and len(ar_valid) == 30
    assert ar_train[10].shape == (33,) and dl_train[10].shape == (32,) and dl_valid[0].shape == (32,)
    # The AR sample index is not reused for diffusion (megatron leaves the flag out of the hash):
    # 2 prefixes x 2 modes of train sample indices.
    assert len([f for f in os.listdir(cache) if f.endswith("-train-sample_index.npy")]) == 4


def test_a_dataset_written_again_gets_new_indices(tmp_path, sp_tok):
    """megatron-core keys its index cache on the prefix, not the data: a dataset rewritten at the
    same prefix would load the old indices (samples that straddle documents no longer there)."""
    prefix, cache = str(tmp_path / "d"), str(tmp_path / "cache")
    _write_ours(prefix, _random_docs(40, vocab=sp_tok.vocab_size - 1), np.uint16)
    first, _ = build_datasets([prefix], "100,0,0", None, 16, False, 3, 50, 0, cache, sp_tok)
    _write_ours(prefix, _random_docs(70, vocab=sp_tok.vocab_size - 1, seed=5), np.uint16)
    again, _ = build_datasets([prefix], "100,0,0", None, 16, False, 3, 50, 0, cache, sp_tok)
    fresh, _ = build_datasets([prefix], "100,0,0", None, 16, False, 3, 50, 0, str(tmp_path / "fresh"), sp_tok)
    assert all(np.array_equal(again[i], fresh[i]) for i in range(50))
    assert len([f for f in os.listdir(cache) if f.endswith("-train-sample_index.npy")]) == 2
    index = max((os.path.join(cache, f) for f in os.listdir(cache) if f.endswith("-train-document_index.npy")),
                key=os.path.getmtime)  # the rewritten dataset's
    open(index, "wb").close()  # an empty cache file: one error naming it
    with pytest.raises(InputError, match=f"index cache {index}: No data left in file; expected a numeric .npy"):
        build_datasets([prefix], "100,0,0", None, 16, False, 3, 50, 0, cache, sp_tok)


def test_a_dataset_rewritten_with_only_middle_documents_moved_gets_new_indices(tmp_path, sp_tok):
    """The same count, .bin size and first and last 2**20 lengths (the corpus preprocessed again
    with its inputs in another order): every length enters the cache key, not a sample of them."""
    prefix, cache, n = str(tmp_path / "d"), str(tmp_path / "cache"), 2**21 + 10
    lengths = np.ones(n, dtype=np.int64)
    lengths[2**20 + 3] = 5  # one long document between the first and the last 2**20, moved in the rewrite

    def write(lengths):
        with IndexedDatasetWriter(prefix, np.uint16) as w:
            w.add_documents(np.arange(int(lengths.sum())) % 100, lengths)

    write(lengths)
    build_datasets([prefix], "100,0,0", None, 4, False, 3, 50, 0, cache, sp_tok)
    write(np.roll(lengths, 1))  # to 2**20 + 4, still between them
    build_datasets([prefix], "100,0,0", None, 4, False, 3, 50, 0, cache, sp_tok)
    assert len([f for f in os.listdir(cache) if f.endswith("-train-sample_index.npy")]) == 2


def test_an_unweighted_blend_shorter_than_the_run_is_one_error(tmp_path, sp_tok):
    """megatron-core sizes an unweighted blend of several prefixes to one epoch of each."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for prefix, seed in ((a, 1), (b, 2)):
        _write_ours(prefix, _random_docs(20, vocab=sp_tok.vocab_size - 1, seed=seed), np.uint16)
    train, _ = build_datasets([a, b], "100,0,0", None, 16, False, 3, 10, 0, str(tmp_path / "c"), sp_tok)
    assert len(train) >= 10
    with pytest.raises(InputError, match=r"--data-path: the unweighted blend of 2 datasets holds \d+ train samples "
                                         r"\(one epoch of each\), fewer than the 5000 the run reads; give weights"):
        build_datasets([a, b], "100,0,0", None, 16, False, 3, 5000, 0, str(tmp_path / "c"), sp_tok)
    train, _ = build_datasets(["1", a, "1", b], "100,0,0", None, 16, False, 3, 5000, 0, str(tmp_path / "c"), sp_tok)
    assert len(train) >= 5000
    # a dataset whose part holds less than one sample would weigh 0 (megatron-core's assertion)
    tiny = str(tmp_path / "tiny")
    _write_ours(tiny, [[5] * 10], np.uint16)
    with pytest.raises(InputError, match=rf"--data-path: the train part of {tiny} holds 10 tokens, less than one "
                                         rf"sample of 17, and an unweighted blend weighs each dataset by its samples"):
        build_datasets([a, tiny], "100,0,0", None, 16, True, 3, 10, 0, str(tmp_path / "c"), sp_tok)
    with pytest.raises(InputError, match=rf"--valid-data-path: the valid part of {tiny} holds 10 tokens"):
        build_datasets([a], None, [a, tiny], 16, False, 3, 10, 4, str(tmp_path / "c"), sp_tok)
    train, _ = build_datasets(["1", a, "1", tiny], "100,0,0", None, 8, False, 3, 10, 0, str(tmp_path / "c"), sp_tok)
    assert len(train) >= 10  # weighted: megatron-core repeats the short one over epochs


def test_megatron_built_dataset_trains(tmp_path, sp_tok):
    prefix = str(tmp_path / "mcore")
    _write_megatron(prefix, _random_docs(40, vocab=sp_tok.vocab_size - 1), np.uint16)
    train, valid = build_datasets([prefix], "80,20", None, 16, False, 3, 50, 5, str(tmp_path / "c"), sp_tok)
    assert train[0].shape == (16,) and valid[0].shape == (16,)
    assert build_datasets([prefix], "969,30,1", None, 16, True, 3, 50, 0, str(tmp_path / "c"), sp_tok)[1] is None
    # a valid part --split gives no weight, yet read: refused; a train part of weight 0 is not built
    # (an evaluation reads the valid split only; the trainer refuses it)
    with pytest.raises(InputError, match=rf"^--data-path: the valid split \(weight 0 in --split\) of {prefix} "
                                         rf"\(40 documents\) is empty; change --split"):
        build_datasets([prefix], "100,0,0", None, 16, False, 3, 50, 5, str(tmp_path / "c"), sp_tok)
    assert build_datasets([prefix], "100,0,0", None, 16, False, 3, 50, 0, str(tmp_path / "c"), sp_tok)[1] is None
    train, valid = build_datasets([prefix], "0,100,0", None, 16, False, 3, 50, 5, str(tmp_path / "c"), sp_tok)
    assert train is None and len(valid) >= 5


def test_datasets_reject_bad_prefixes(tmp_path, demo, sp_tok):
    args = dict(split="969,30,1", valid_data_path=None, seq_length=16, add_extra_token=False, seed=1,
                num_train_samples=10, num_valid_samples=0, cache_path=str(tmp_path / "c"), tokenizer=sp_tok)
    with pytest.raises(ValueError, match="--data-path: no dataset at prefix .*nowhere"):
        build_datasets(data_path=[str(tmp_path / "nowhere")], **args)
    big = str(tmp_path / "big")
    _write_ours(big, [[1, 2, 3], [4, sp_tok.vocab_size + 5]], np.uint16)
    with pytest.raises(ValueError,
                       match=rf"big.bin holds token ids in \[1, {sp_tok.vocab_size + 5}\].*vocab_size=4097"):
        build_datasets(data_path=[big], **args)
    masked = str(tmp_path / "masked")  # the appended [MASK] id never belongs in data
    _write_ours(masked, [[1, 2, sp_tok.mask_id]], np.uint16)
    with pytest.raises(ValueError, match="masked.bin"):
        build_datasets(data_path=[masked], **args)
    bad = str(tmp_path / "bad")
    _write_ours(bad, [[1, 2, 3]], np.uint16)
    _corrupt(bad, ".idx", offset=0, data=b"NOTMEGA")
    with pytest.raises(DatasetFormatError, match="bad.idx"):
        build_datasets(data_path=[demo["data_prefix"]], **{**args, "valid_data_path": [bad], "split": None,
                                                          "num_valid_samples": 4})


# ---------------------------------------------------------------- torch.distributed (gloo)


def _dist_worker(rank, world, init_file, demo, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    tok = build_tokenizer(demo["tokenizer_type"], demo["tokenizer_model"])
    train, valid = build_datasets([demo["data_prefix"]], None, [demo["valid_prefix"]], 32, False, 5,
                                  200, 10, os.path.join(out_dir, "cache"), tok)
    np.save(os.path.join(out_dir, f"rank{rank}.npy"), np.stack([train[i] for i in range(8)] + [valid[0]]))
    dist.barrier()
    dist.destroy_process_group()


def test_datasets_under_torch_distributed(tmp_path, demo):
    # fork: the children inherit the imported megatron-core (spawn would re-import it, ~5 s each)
    torch.multiprocessing.start_processes(_dist_worker, args=(2, str(tmp_path / "init"), demo, str(tmp_path)),
                                          nprocs=2, start_method="fork")
    np.testing.assert_array_equal(np.load(tmp_path / "rank0.npy"), np.load(tmp_path / "rank1.npy"))


def test_a_different_tokenizer_is_refused_naming_both(tmp_path, jsonl_corpus, demo, sp_tok):
    """The sidecar written by preprocessing catches a tokenizer mismatch even when every id
    would fit the other vocabulary (which the id-range check alone cannot see)."""
    from types import SimpleNamespace

    from megatron_dllm.data.datasets import check_prefix
    from megatron_dllm.data.indexed_dataset import read_metadata
    from megatron_dllm.data.prep.merge import merge_datasets

    prefix = preprocess([jsonl_corpus], str(tmp_path / "a"), demo["tokenizer_type"],
                        demo["tokenizer_model"], append_eod=True).output_prefixes["text"]
    assert read_metadata(prefix)["vocab_size"] == sp_tok.vocab_size == 4097
    check_prefix(prefix, "--data-path", sp_tok, None)  # the tokenizer it was made with
    bigger = SimpleNamespace(name="TikTokenizer", model_path="/m/o200k.tiktoken", vocab_size=200_001,
                             mask_id=200_000, mask_appended=True)
    with pytest.raises(ValueError, match=r"was preprocessed with SentencePieceTokenizer .*vocab_size=4097.* "
                                         r"but --tokenizer-model gives TikTokenizer "
                                         r"\(o200k.tiktoken, vocab_size=200001\)"):
        check_prefix(prefix, "--data-path", bigger, None)
    merged = str(tmp_path / "merged")
    merge_datasets([prefix, prefix], merged)
    assert read_metadata(merged) == read_metadata(prefix)
    other = str(tmp_path / "other")
    _write_ours(other, _random_docs(5), np.uint16)  # no sidecar: made elsewhere
    with pytest.raises(ValueError, match="different tokenizers"):
        merge_datasets([prefix, other], str(tmp_path / "mixed"))
