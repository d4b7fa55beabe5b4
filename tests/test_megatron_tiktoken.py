"""Megatron-LM's TikTokenizer JSON vocabulary: preprocessing byte-identical to Megatron-LM's own
tools/preprocess_data.py (md5s recorded from a run of Megatron-LM core_v0.16.1, see
tests/data/megatron_tiktoken/record_megatron.py), the id layout, bad input, a checkpoint's
tokenizer record, and the HF export's tokenizer reproducing the ids.

The vocabulary is mistral-common's tekken_240911.json "vocab" list (150,000 real BPE ranks in
this format), written to a JSON file once per module.
"""
import base64
import hashlib
import json
import os
import re

import pytest
from conftest import tekken_vocab

from megatron_dllm.checkpoint import CheckpointError
from megatron_dllm.checkpoint.tokenizer_record import TokenizerRecord, recorded_tokenizer_config
from megatron_dllm.cli.preprocess_data import main as preprocess_main
from megatron_dllm.config.data import TokenizerConfig
from megatron_dllm.data.prep.demo import shakespeare_files
from megatron_dllm.data.tokenizers import build_tokenizer, tokenizer_fingerprint

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data", "megatron_tiktoken")
FIXTURE = os.path.join(DATA, "fixture.jsonl")
RECORDED = json.load(open(os.path.join(DATA, "recorded.json")))


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    return tekken_vocab(tmp_path_factory.mktemp("vocab"))


@pytest.fixture(scope="module")
def texts():
    with open(FIXTURE, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def _md5(path) -> str:
    return hashlib.md5(open(path, "rb").read()).hexdigest()


def _preprocess(vocab, prefix, flags, workers=1) -> str:
    argv = ["--input", FIXTURE, "--tokenizer-type", "TikTokenizer", "--tokenizer-model", vocab,
            "--output-prefix", str(prefix), "--workers", str(workers), "--no-progress", *flags]
    assert preprocess_main(argv) == 0
    return f"{prefix}_text_document"


@pytest.mark.parametrize("case", RECORDED["cases"], ids=[c["name"] for c in RECORDED["cases"]])
def test_preprocess_is_byte_identical_to_megatron_lm(tmp_path, vocab, case):
    out = _preprocess(vocab, tmp_path / case["name"], case["flags"])
    assert (_md5(out + ".bin"), _md5(out + ".idx")) == (case["bin_md5"], case["idx_md5"])


def test_a_document_that_spells_the_mask_token_is_rejected(tmp_path, vocab):
    """Megatron-LM encodes `<mask>` in a document as the mask id (its specials are parsed in the
    text); no diffusion model can learn to predict it, so such a document is rejected by name
    (the fixture above holds every other special token in its text)."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"text": "fill the <mask> here"}) + "\n" + json.dumps({"text": "plain"}) + "\n")
    argv = ["--input", str(docs), "--tokenizer-type", "TikTokenizer", "--tokenizer-model", vocab,
            "--output-prefix", str(tmp_path / "out"), "--no-progress"]
    assert preprocess_main(argv) == 0
    report = open(str(tmp_path / "out_text_document_rejected.tsv")).read()
    assert f"{docs}\t1\ttext\tmask_token" in report


@pytest.mark.slow
def test_preprocess_with_workers_is_byte_identical(tmp_path, vocab):
    case = next(c for c in RECORDED["cases"] if c["name"] == "v2_eod_specials")
    out = _preprocess(vocab, tmp_path / "w2", case["flags"], workers=2)
    assert (_md5(out + ".bin"), _md5(out + ".idx")) == (case["bin_md5"], case["idx_md5"])


def test_id_layout_specials_first_and_ranks_cut(vocab, texts):
    tok = build_tokenizer("TikTokenizer", vocab)  # Megatron's defaults: v2, 1000 specials, 131072
    assert (tok.vocab_size, tok.mask_id, tok.eod, tok.bos, tok.mask_appended) == (131072, 3, 2, 1, False)
    assert tok.tokenize("\x00") == [1000]  # rank 0 (byte 0) follows the 1000 specials
    assert tok.tokenize("<unk><s></s><mask><pad><cls><sep><SPECIAL_7><SPECIAL_999>") == [0, 1, 2, 3, 4, 5, 6, 7, 999]
    ids = [i for t in texts for i in tok.tokenize(t)]
    german = next(t for t in texts if "Größe" in t)
    assert max(ids) > 100000 and tok.detokenize(tok.tokenize(german)) == german
    small = build_tokenizer("TikTokenizer", vocab, vocab_size=32000)
    small_ids = [i for t in texts for i in small.tokenize(t)]
    assert max(small_ids) < 32000 and len(small_ids) > len(ids)  # fewer merges kept: more tokens
    assert small.detokenize(small.tokenize(german)) == german
    v1 = build_tokenizer("TikTokenizer", vocab, pattern="v1")
    assert [v1.tokenize(t) for t in texts] != [tok.tokenize(t) for t in texts]  # v2 also splits at case changes
    custom = build_tokenizer("TikTokenizer", vocab, num_special_tokens=10, vocab_size=60000,
                             special_tokens=["<s>", "</s>", "<unk>", "<pad>", "<cls>", "<sep>", "<|x|>", "<mask>"])
    assert (custom.mask_id, custom.eod, custom.bos, custom.vocab_size) == (7, 1, 0, 60000)
    assert custom.tokenize("<|x|> <SPECIAL_9>") == [6, 42, 9]  # 42 = " " (rank 32) + 10 specials


@pytest.mark.parametrize("flags, expected", [
    (["--tiktoken-pattern", "llama3"], "--tiktoken-pattern 'llama3': Megatron-LM's JSON vocabulary takes v1 or v2"),
    (["--tokenizer-special-tokens", "<unk>", "<s>", "</s>"], "--tokenizer-special-tokens: missing ['<mask>'"),
    (["--vocab-size", "200000"], "has 150000 ranks; --vocab-size 200000 with 1000 special tokens needs 199000"),
    (["--tiktoken-num-special-tokens", "3"], "--tiktoken-num-special-tokens 3: expected at least the 7"),
    (["--tokenizer-special-tokens", "<unk>", "--tiktoken-special-tokens", "<s>"],
     "--tokenizer-special-tokens and --tiktoken-special-tokens: give one of them"),
])
def test_bad_flags_are_one_error_line(tmp_path, vocab, capsys, flags, expected):
    argv = ["--input", FIXTURE, "--tokenizer-type", "TikTokenizer", "--tokenizer-model", vocab,
            "--output-prefix", str(tmp_path / "x"), "--no-progress", *flags]
    assert preprocess_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err
    assert not list(tmp_path.iterdir())


def test_bad_vocabulary_files_are_named(tmp_path, vocab):
    records = json.load(open(vocab))[:2000]
    records[300]["rank"] = 301
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(records))
    with pytest.raises(ValueError, match=r"bad.json.*record 300 is not \{rank: 300"):
        build_tokenizer("TikTokenizer", str(bad), vocab_size=1500)
    (tmp_path / "obj.json").write_text("{}")
    with pytest.raises(ValueError, match="expected a JSON list"):
        build_tokenizer("TikTokenizer", str(tmp_path / "obj.json"))
    with pytest.raises(ValueError, match="--vocab-size applies to Megatron-LM's JSON TikTokenizer"):
        build_tokenizer("TikTokenizer", str(tmp_path / "x.tiktoken"), vocab_size=1000)


def test_checkpoint_record_restores_the_same_tokenizer(vocab, texts):
    given = TokenizerConfig("TikTokenizer", vocab, tiktoken_pattern="v1", tiktoken_num_special_tokens=100,
                            vocab_size=50000, tokenizer_special_tokens=["<unk>", "<s>", "</s>", "<pad>", "<mask>",
                                                                        "<cls>", "<sep>"])
    stored = json.loads(json.dumps(TokenizerRecord.of(given).as_dict()))  # as stored in a checkpoint
    record = TokenizerRecord.from_dict(stored, "ckpt")
    assert record.sha256 == tokenizer_fingerprint(vocab)  # the list alone, not an HF tokenizer_config
    restored = recorded_tokenizer_config(record, None, "ckpt")  # no flags: the record
    assert recorded_tokenizer_config(record, TokenizerConfig("TikTokenizer", vocab), "ckpt") == restored  # type+model
    tok, original = restored.build(), given.build()
    assert (tok.vocab_size, tok.mask_id, tok.eod) == (50000, 4, 2)
    assert [tok.tokenize(t) for t in texts] == [original.tokenize(t) for t in texts]
    assert recorded_tokenizer_config(record, given, "ckpt") == given  # the recorded options, as flags


SPECIALS = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]  # megatron-core's default


@pytest.mark.parametrize("recorded, flags, message", [
    ({"vocab_size": 1500}, {"tiktoken_pattern": "v1", "vocab_size": 1500}, "--tiktoken-pattern v1 but ckpt was "
                                                                            "trained with v2"),
    ({"tiktoken_pattern": "v1", "vocab_size": 1500}, {"vocab_size": 1500}, "--tiktoken-pattern v2 but ckpt was "
                                                                           "trained with v1"),  # v2: the default
    ({"vocab_size": 1500}, {"vocab_size": 1600}, "--vocab-size 1600 but ckpt was trained with 1500"),
    ({"vocab_size": 1500}, {"vocab_size": 1500, "tiktoken_num_special_tokens": 100},
     "--tiktoken-num-special-tokens 100 but ckpt was trained with 1000"),
    ({"vocab_size": 1500}, {"vocab_size": 1500, "tokenizer_special_tokens": SPECIALS[::-1]},
     f"--tokenizer-special-tokens {' '.join(SPECIALS[::-1])} but ckpt was trained with {' '.join(SPECIALS)}"),
])
def test_tokenizer_options_other_than_the_recorded_ones_are_refused(tmp_path, recorded, flags, message):
    """Export and sampling take tokenizer flags only with the ids the checkpoint was trained with:
    each option, the tokenizer's default where no flag gives it, against the recorded one."""
    vocab = tekken_vocab(tmp_path, 2000)
    record = TokenizerRecord.of(TokenizerConfig("TikTokenizer", vocab, **recorded))
    with pytest.raises(CheckpointError, match=f"^{re.escape(message)} \\(give its tokenizer options, or only "
                                              f"--tokenizer-type/--tokenizer-model to use the recorded ones\\)$"):
        recorded_tokenizer_config(record, TokenizerConfig("TikTokenizer", vocab, **flags), "ckpt")


def test_tokenizer_flags_that_say_the_recorded_defaults_again_are_taken(tmp_path):
    vocab = tekken_vocab(tmp_path, 2000)
    record = TokenizerRecord.of(TokenizerConfig("TikTokenizer", vocab, vocab_size=1500))
    said_again = TokenizerConfig("TikTokenizer", vocab, tiktoken_pattern="v2", tiktoken_num_special_tokens=1000,
                                 tokenizer_special_tokens=SPECIALS, vocab_size=1500)
    assert recorded_tokenizer_config(record, said_again, "ckpt") == said_again


def test_tiktoken_file_options_other_than_the_recorded_ones_are_refused(tmp_path):
    path = tmp_path / "bytes.tiktoken"  # the 256 single bytes, ranks 0..255
    path.write_bytes(b"".join(base64.b64encode(bytes([b])) + b" %d\n" % b for b in range(256)))
    record = TokenizerRecord.of(TokenizerConfig("TikTokenizer", str(path)))  # pattern llama3, the default
    with pytest.raises(CheckpointError, match="^--tiktoken-pattern cl100k but ckpt was trained with llama3 "):
        recorded_tokenizer_config(record, TokenizerConfig("TikTokenizer", str(path), tiktoken_pattern="cl100k"), "ckpt")
    with pytest.raises(CheckpointError, match="^--tiktoken-num-special-tokens 8 but ckpt was trained with 2 "):
        recorded_tokenizer_config(record, TokenizerConfig("TikTokenizer", str(path), tiktoken_num_special_tokens=8),
                                  "ckpt")
    for same in (TokenizerConfig("TikTokenizer", str(path), tiktoken_pattern="llama3"),  # the defaults, as flags
                 TokenizerConfig("TikTokenizer", str(path), tiktoken_num_special_tokens=2)):  # no fillers either way
        assert recorded_tokenizer_config(record, same, "ckpt") == same


@pytest.mark.slow
def test_hf_export_tokenizer_reproduces_ids(tmp_path, vocab, texts):
    from transformers import AutoTokenizer

    from megatron_dllm.hf.export import export_tokenizer

    ours = build_tokenizer("TikTokenizer", vocab)
    export_tokenizer(str(tmp_path), "TikTokenizer", vocab, ours.vocab_size, ours.mask_id)
    hf = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    # the export's BOS is the EOD: documents start after one in training, never after <s>
    assert (len(hf), hf.mask_token_id, hf.eos_token_id, hf.bos_token_id) == (131072, 3, 2, 2)
    real = texts + [open(shakespeare_files()[0], encoding="utf-8").read()[:60000]]
    for text in real:  # incl. the fixture's specials, CJK, Cyrillic, emoji, CRLF and whitespace runs
        ids = ours.tokenize(text)
        assert hf.encode(text, add_special_tokens=False) == ids
        assert hf.decode(ids) == ours._enc.decode(ids)


@pytest.mark.slow
def test_train_then_export_and_sample_restore_the_tokenizer(tmp_path, vocab, texts, capsys):
    """Train on data made with a cut Megatron vocabulary (100 specials, 1200 ids); export and
    sampling given only type and model (or nothing) rebuild it from the checkpoint's record;
    tokenizer flags given to an evaluation win over the record."""
    import importlib

    from conftest import run_pretrain
    from transformers import AutoTokenizer

    from megatron_dllm import platform
    from megatron_dllm.sampling import load_inference_model

    options = ["--tiktoken-num-special-tokens", "100", "--vocab-size", "1200"]
    data = _preprocess(vocab, tmp_path / "data", ["--append-eod", *options])
    ckpt, hf = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    run_pretrain(1, ["--family", "mdlm", "--preset", "cpu-tiny", "--seq-length", "32", "--micro-batch-size", "2",
                     "--global-batch-size", "4", "--train-iters", "2", "--eval-interval", "100", "--eval-iters", "1",
                     "--data-path", data, "--tokenizer-type", "TikTokenizer", "--tokenizer-model", vocab, *options,
                     "--save", ckpt, "--tensorboard-dir", str(tmp_path / "tb")], tmp_path)
    ours = build_tokenizer("TikTokenizer", vocab, num_special_tokens=100, vocab_size=1200)
    convert = importlib.import_module("megatron_dllm.cli.convert_to_hf")
    evaluate = importlib.import_module("megatron_dllm.cli.evaluate")
    try:
        assert convert.main(["--load", ckpt, "--out", hf, "--tokenizer-type", "TikTokenizer",
                             "--tokenizer-model", vocab]) == 0
        inf = load_inference_model(ckpt)  # no tokenizer flags: the recorded one
        problems = tmp_path / "gsm8k.jsonl"
        problems.write_text(json.dumps({"question": "1 + 1?", "answer": "#### 2"}) + "\n")
        for command in (["nelbo", "--data-path", data], ["gsm8k", "--data", str(problems)]):
            capsys.readouterr()
            assert evaluate.main([*command, "--load", ckpt, "--tokenizer-type", "TikTokenizer", "--tokenizer-model",
                                  vocab, "--tiktoken-num-special-tokens", "100", "--vocab-size", "1300"]) == 2
            assert "1300" in capsys.readouterr().err  # the flag reached the loader, which refuses it
    finally:
        platform.destroy_distributed()
    assert (inf.vocab_size, inf.mask_id, inf.tokenizer.vocab_size, inf.tokenizer.mask_id) == (1200, 3, 1200, 3)
    exported = AutoTokenizer.from_pretrained(hf, local_files_only=True)
    assert (len(exported), exported.mask_token_id, exported.eos_token_id) == (1200, 3, 2)
    for text in texts:
        assert inf.tokenizer.tokenize(text) == ours.tokenize(text)
        assert exported.encode(text, add_special_tokens=False) == ours.tokenize(text)
