"""SFT data: rendering of the three input formats, rows (EOS padding, packing, dropped examples),
the prompt mask and its validation, and the epoch order of SFT samples."""
import json
import os

import numpy as np
import pytest
import zstandard

from megatron_dllm.data import sft
from megatron_dllm.data.prep import sft_preprocess as prep_sft
from megatron_dllm.errors import InputError


@pytest.fixture(scope="module")
def tokenizer(demo_cache):
    from megatron_dllm.data.tokenizers import build_tokenizer

    return build_tokenizer("SentencePieceTokenizer", os.path.join(demo_cache, "shakespeare_bpe4096.model"))


def _write(path, lines):
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


def test_renderings():
    assert prep_sft.render_deng("How many?||3 + 4 = 7 #### 7") == ("Question: How many?\n", "Answer: 3 + 4 = 7\n#### 7")
    prompt, response = prep_sft.render_messages([{"role": "system", "content": "be brief"},
                                            {"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "hello"}])
    assert prompt == "System: be brief\nUser: hi\nAssistant: " and response == "hello"
    with pytest.raises(ValueError, match="assistant"):
        prep_sft.render_messages([{"role": "user", "content": "hi"}])


def test_rows_pad_with_eos_and_drop_long_examples():
    stats = prep_sft.SFTStats()
    rows = list(prep_sft.build_rows([([1, 2], [3]), ([1] * 5, [2] * 5), ([7], [8, 9])], 6, eos_id=0,
                               packing=False, stats=stats))
    assert [r.tolist() for r, _ in rows] == [[1, 2, 3, 0, 0, 0], [7, 8, 9, 0, 0, 0]]
    assert [m.tolist() for _, m in rows] == [[1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]]
    assert (stats.examples, stats.dropped_too_long, stats.rows, stats.padding_tokens) == (3, 1, 2, 4)
    # an example of exactly seq_length tokens (its EOS included) fits
    assert len(list(prep_sft.build_rows([([1, 2], [3, 4, 5])], 6, 0, False, prep_sft.SFTStats()))) == 1


def test_packing_keeps_examples_whole():
    stats = prep_sft.SFTStats()
    rows = list(prep_sft.build_rows([([1], [2]), ([3], [4]), ([5, 5], [6, 6])], 7, eos_id=0, packing=True, stats=stats))
    assert [r.tolist() for r, _ in rows] == [[1, 2, 0, 3, 4, 0, 0], [5, 5, 6, 6, 0, 0, 0]]
    assert [m.tolist() for _, m in rows] == [[1, 0, 0, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0]]


def test_preprocess_all_formats_and_validate(tmp_path, tokenizer):
    a = _write(tmp_path / "a.jsonl", [json.dumps({"prompt": "Question: 2+3?\n", "response": "5"}),
                                      json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                               {"role": "assistant", "content": "hello"}]}),
                                      json.dumps({"prompt": "x", "response": "word " * 100})])
    d = _write(tmp_path / "d.txt", ["\ufeffA has 3||3 + 4 = 7 #### 7"])  # a byte-order mark is not text
    dz = tmp_path / "d.txt.zst"  # Deng text compressed is still Deng text, not JSONL
    dz.write_bytes(zstandard.ZstdCompressor().compress(b"B has 2||2 + 2 = 4 #### 4\n"))
    prefix = str(tmp_path / "sft")
    # temporaries of a killed run (no process has pid 999999999) are removed, not left beside the dataset
    stale = [prefix + ".bin.tmp-999999999-0a1b2c3d", sft.mask_prefix(prefix) + ".idx.tmp-999999999-0a1b2c3d.lengths"]
    for path in stale:
        open(path, "wb").close()
    logged = []
    stats = prep_sft.preprocess_sft([a, d, str(dz)], prefix, tokenizer, 48, log=logged.append)
    assert (stats.examples, stats.dropped_too_long, stats.rows) == (5, 1, 4)
    assert not any(map(os.path.exists, stale)) and "removed 2 temporary files of an interrupted run" in logged[0]
    meta = sft.validate_sft_dataset(prefix)
    assert meta["seq_length"] == 48 and meta["rows"] == 4
    rows = sft.SFTRows(prefix)
    for i, question, answer in ((2, "A has 3", "3 + 4 = 7\n#### 7"), (3, "B has 2", "2 + 2 = 4\n#### 4")):
        tokens, mask = rows.row(i)  # the Deng examples
        prompt = tokenizer.tokenize(f"Question: {question}\n")
        response = tokenizer.tokenize(f"Answer: {answer}") + [tokenizer.eod]
        n = len(prompt) + len(response)
        assert tokens.tolist() == prompt + response + [tokenizer.eod] * (48 - n)
        assert mask.tolist() == [True] * len(prompt) + [False] * (48 - len(prompt))
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]  # nothing left half-written


def test_validation_catches_a_bad_mask(tmp_path, tokenizer, capsys):
    a = _write(tmp_path / "a.jsonl", [json.dumps({"prompt": "p", "response": "r"})] * 3)
    prefix = str(tmp_path / "sft")
    prep_sft.preprocess_sft([a], prefix, tokenizer, 16)
    with open(sft.mask_prefix(prefix) + ".bin", "r+b") as f:  # a row that is all prompt
        f.write(bytes([1] * 16))
    with pytest.raises(ValueError, match="row 0 has no response token"):
        sft.validate_sft_dataset(prefix)
    from megatron_dllm.cli.inspect_dataset import main

    assert main([prefix, "--verify"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {sft.mask_prefix(prefix)}.bin: row 0 has no response token"]


def test_merging_an_sft_dataset_is_refused(tmp_path, tokenizer, capsys):
    """Its rows' prompt masks live in files of their own that a merge would not carry."""
    from megatron_dllm.cli.merge_datasets import main

    a = _write(tmp_path / "a.jsonl", [json.dumps({"prompt": "p", "response": "r"})] * 3)
    for name in ("one", "two"):
        prep_sft.preprocess_sft([a], str(tmp_path / name), tokenizer, 16)
    assert main(["--input", str(tmp_path / "one"), str(tmp_path / "two"), "--output-prefix", str(tmp_path / "m")]) == 2
    assert "an SFT dataset (tools/preprocess_sft_data.py), whose prompt masks are not merged" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "m.bin")


@pytest.mark.parametrize("record, message", [
    (json.dumps({"prompt": 3}), "expected string fields 'prompt' and 'response', or 'messages'"),
    (json.dumps({"prompt": "bad \ud800 surrogate", "response": "x"}),  # json.dumps writes the \ud800 escape
     "a lone surrogate (a JSON \\ud800-\\udfff escape), expected valid Unicode text"),
    ('{"prompt": "p", "response": "r", "a": ' + "[" * 1500 + "]" * 1500 + "}", "JSON nested too deeply to parse"),
], ids=["not-a-string", "lone-surrogate", "nested-too-deeply"])
def test_malformed_record_is_one_error_line_and_nothing_published(tmp_path, demo_cache, capsys, record, message):
    from megatron_dllm.cli.preprocess_sft import main

    a = _write(tmp_path / "a.jsonl", [json.dumps({"prompt": "p", "response": "r"}), record])
    assert main(["--input", a, "--output-prefix", str(tmp_path / "out"), "--seq-length", "16",
                 "--tokenizer-type", "SentencePieceTokenizer",
                 "--tokenizer-model", os.path.join(demo_cache, "shakespeare_bpe4096.model")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {a}:2: {message}"]
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl"]


def test_an_example_that_spells_the_mask_piece_is_one_error_line(tmp_path, paragraphs):
    """With a tokenizer whose own vocabulary holds the mask piece (SentencePiece's <mask>), text
    that spells it would put the [MASK] id among the targets: no diffusion model can predict it."""
    import sentencepiece as spm

    from megatron_dllm.data.tokenizers import build_tokenizer

    spm.SentencePieceTrainer.train(sentence_iterator=iter(paragraphs), model_prefix=str(tmp_path / "m"),
                                   vocab_size=300, user_defined_symbols=["<mask>"], model_type="bpe",
                                   num_threads=1, minloglevel=2)
    tok = build_tokenizer("SentencePieceTokenizer", str(tmp_path / "m.model"))
    a = _write(tmp_path / "a.jsonl", [json.dumps({"prompt": "Fill in: ", "response": "the <mask> here"})])
    with pytest.raises(InputError, match=r"a.jsonl: the example 'Fill in: the <mask> here' spells the tokenizer's "
                                         r"mask piece \(id 3\)"):
        prep_sft.preprocess_sft([a], str(tmp_path / "sft"), tok, 48)
    assert not [f for f in os.listdir(tmp_path) if f.startswith("sft")]  # nothing published


def test_samples_cover_each_epoch_once_and_are_reproducible(tmp_path, tokenizer):
    a = _write(tmp_path / "a.jsonl", [json.dumps({"prompt": f"p{i}", "response": f"r{i}"}) for i in range(10)])
    prefix = str(tmp_path / "sft")
    prep_sft.preprocess_sft([a], prefix, tokenizer, 16)
    rows = sft.SFTRows(prefix)
    train = sft.SFTSamples(rows, 0, 8, seed=5, extra_token=True)
    epoch = lambda e: sorted(tuple(train.sample(e * 8 + j)[0][:-1]) for j in range(8))  # noqa: E731
    assert epoch(0) == epoch(1) == sorted(tuple(rows.row(i)[0]) for i in range(8))
    assert [train.sample(j)[0].tolist() for j in range(8)] != [train.sample(8 + j)[0].tolist() for j in range(8)]
    again = sft.SFTSamples(rows, 0, 8, seed=5, extra_token=True)
    assert all(np.array_equal(again.sample(i)[0], train.sample(i)[0]) for i in range(20))
    tokens, mask = train.sample(3)
    assert len(tokens) == 17 and tokens[-1] == tokenizer.eod and not mask[-1]
    assert sft.split_rows(100, "90,10,0") == ((0, 90), (90, 100))


def test_arithmetic_task_steps_are_right_and_test_pairs_held_out(tmp_path):
    from megatron_dllm.data.prep.arithmetic import column_steps, write_task

    assert column_steps(47, 8) == "7+8=15, 4+1=5" and column_steps(97, 5) == "7+5=12, 9+1=10"
    assert column_steps(3, 4) == "3+4=7, 0+0=0" and column_steps(999, 1) == "9+1=10, 9+1=10, 9+1=10"
    for a, b in [(a, b) for a in range(0, 1000, 7) for b in range(0, 100, 3)]:
        # the answer is read off the steps: the last column's sum, then each earlier column's units digit
        sums = [step.split("=")[1] for step in column_steps(a, b).split(", ")]
        assert int(sums[-1] + "".join(s[-1] for s in reversed(sums[:-1]))) == a + b
    task = write_task(str(tmp_path), max_operand=100, max_second=10, test_size=100)
    train = [line.split("||")[0] for line in open(task["train"])]
    test = [json.loads(line) for line in open(task["test"])]
    assert len(train) == 900 and len(test) == 100 and not {t["question"] for t in test} & set(train)
    assert len(set(train)) == 900
    for record in test:  # "What is a plus b?" -> "...\n#### a+b"
        a, b = record["question"][len("What is "):-1].split(" plus ")
        assert record["answer"] == f"{column_steps(int(a), int(b))}\n#### {int(a) + int(b)}"
    with pytest.raises(ValueError, match="--reasoning"):
        write_task(str(tmp_path), reasoning="digits")
