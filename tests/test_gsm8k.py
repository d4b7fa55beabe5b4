"""GSM8K scoring (megatron_dllm/evaluation/gsm8k.py): answer extraction on tricky strings, the three
input formats and the shipped test set, and the accounting of accuracy and throughput."""
import json

import pytest
from test_sampling import MASK, V, random_model

from megatron_dllm.evaluation import gsm8k
from megatron_dllm.hf.random_model import random_dense_model
from megatron_dllm.sampling import InferenceModel


@pytest.mark.parametrize("text,answer", [
    ("so 3 + 4 = 7\n#### 7", "7"),
    ("#### 1,234", "1234"),
    ("She makes $18.\n#### $18", "18"),
    ("#### -5", "-5"),
    ("####-3", "-3"),
    ("#### 18.00", "18"),
    ("#### 0.50", "0.5"),
    ("#### -0", "0"),
    ("#### $1,000.00.", "1000"),
    ("#### 5 dollars", "5"),
    ("first #### 7 then #### 8", "8"),
    ("#### 12\n#### 13\nQuestion: next", "13"),
    ("#### 72\nQuestion: how many #### is 4?", "4"),
    ("#### twelve", "twelve"),
    ("the answer is 42", None),
    ("####", None),
])
def test_extract_answer(text, answer):
    assert gsm8k.extract_answer(text) == answer


def test_shipped_test_set():
    problems = gsm8k.load_problems()
    assert len(problems) == 1319
    assert problems[0].question.startswith("Janet") and problems[0].gold == "18"
    assert all(p.gold is not None for p in problems)


def test_input_formats_and_errors(tmp_path):
    std = tmp_path / "test.jsonl"
    std.write_text(json.dumps({"question": "Q1?", "answer": "1 + 1 = 2\n#### 2"}) + "\n"
                   + json.dumps({"doc": {"question": "Q2?", "answer": "#### 1,500"}}) + "\n",
                   encoding="utf-8-sig")  # a byte-order mark (Windows tools) is not part of the first record
    assert [(p.question, p.gold) for p in gsm8k.load_problems(str(std))] == [("Q1?", "2"), ("Q2?", "1500")]
    deng = tmp_path / "test.txt"
    deng.write_text("How many?||3 + 4 = 7 #### 7\n")
    assert [(p.question, p.gold) for p in gsm8k.load_problems(str(deng))] == [("How many?", "7")]
    deng.write_text("How many?||3 + 4 = 7 #### 7\nHow many more? 3 + 4 = 7 #### 7\n")
    with pytest.raises(ValueError, match=r"test.txt:2: expected 'question\|\|solution #### answer'"):
        gsm8k.load_problems(str(deng))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "Q?", "answer": "no final answer"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: the reference solution has no"):
        gsm8k.load_problems(str(bad))
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(std.read_bytes().replace(b"\n", b"\r\n") + b"\xff\xfe\x00\n")  # CRLF lines, then bytes
    with pytest.raises(ValueError, match=r"--data .*binary.jsonl:3: not UTF-8 text"):
        gsm8k.load_problems(str(binary))


class DigitTokenizer:
    """ids 1..10 = '0'..'9', 11 = '#', 12 = ' ', 13 = '\\n', 14.. = other characters; EOS 0."""

    eod = 0
    chars = "0123456789# \nQuestion:?"

    def tokenize(self, text):
        return [self.chars.index(c) + 1 for c in text if c in self.chars]

    def detokenize(self, ids):
        return "".join(self.chars[i - 1] for i in ids if 0 < i <= len(self.chars))


def test_accuracy_and_throughput_accounting(tmp_path):
    tok = DigitTokenizer()
    inf = InferenceModel(random_model("mdlm", length=48), "mdlm", MASK, V, 48, tok, "hf")
    problems = [gsm8k.Problem(i, f"{i}?", str(i), f"#### {i}") for i in range(2)]
    out = tmp_path / "pred.jsonl"
    result = gsm8k.evaluate_gsm8k(inf, problems, max_new_tokens=8, predictions=str(out))
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == [0, 1]
    assert result["generated_tokens"] == sum(r["generated_tokens"] for r in records)
    assert all(1 <= r["generated_tokens"] <= 8 for r in records)
    assert result["correct"] == sum(r["correct"] for r in records)
    assert all(r["correct"] == (r["extracted"] == r["gold"]) for r in records)
    assert result["throughput_tokens_per_s"] == pytest.approx(result["generated_tokens"] / result["generation_seconds"])
    assert result["model_calls"] == result["generated_tokens"]  # left to right at batch 1: one call per token
    assert records[0]["prompt"] == "Question: 0?\n"
    # the model's own greedy generation, decoded, is what was scored
    from megatron_dllm.sampling.conditional import generate_left_to_right

    again = generate_left_to_right(inf, tok.tokenize("Question: 1?\n"), 8, 0)
    assert records[1]["generation"] == tok.detokenize([i for i in again if i != 0])


@pytest.mark.parametrize("family,protocol,sampler", [
    ("ar", "left-to-right", {}), ("mdlm", "left-to-right", {}), ("duo", "native", {}), ("esolm", "left-to-right", {}),
    ("esolm", "native", {}), ("mdlm", "native", {"predictor": "threshold", "block_length": 3, "greedy": True}),
    ("bd3lm", "left-to-right", {}), ("bd3lm", "native", {})])
def test_batched_evaluation_gives_the_batch_1_answers(tmp_path, family, protocol, sampler):
    """--batch-size 2 and auto: every problem's generation, answer and the accuracy equal batch 1's."""
    tok = DigitTokenizer()
    options = {"block_size": 4, "noise": "mask"} if family == "bd3lm" else None
    model = random_dense_model(family, V, 48, hidden_size=32, seed=0, family_options=options).double()
    inf = InferenceModel(model, family, MASK, V, 48, tok, "hf", family_options=options)
    questions = ["1?", "12 + 30?", "7", "100 - 1 is?", "3 3?"]
    problems = [gsm8k.Problem(i, q, str(i), f"#### {i}") for i, q in enumerate(questions)]
    runs = {}
    for batch_size in (1, 2, "auto"):
        out = tmp_path / f"pred-{batch_size}.jsonl"
        result = gsm8k.evaluate_gsm8k(inf, problems, protocol, max_new_tokens=8, steps=4, predictions=str(out),
                                      batch_size=batch_size, **sampler)
        # the batch size that ran (auto: 8 on CPU, capped by the 5 problems), and the one requested
        assert (result["batch_size"], result["batch_size_requested"]) == ({1: 1, 2: 2, "auto": 5}[batch_size],
                                                                          batch_size)
        runs[batch_size] = (result["accuracy"], result["generated_tokens"], out.read_text())
    assert runs[1] == runs[2] == runs["auto"]
    generations = [json.loads(line)["generation"] for line in runs[1][2].splitlines()]
    assert len(set(generations)) > 1  # distinct prompts, distinct answers: a row mix-up would show


@pytest.mark.parametrize("value", ["0", "-2", "big"])
def test_bad_batch_size_is_one_line_naming_the_flag(value, capsys):
    from megatron_dllm.cli.evaluate import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["gsm8k", "--load", "x", "--batch-size", value])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert "--batch-size" in err and value in err
    assert build_parser().parse_args(["gsm8k", "--load", "x", "--batch-size", "auto"]).batch_size == "auto"


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_auto_batch_backs_off_only_where_out_of_memory_raises(device):
    """`--batch-size auto` (platform.auto_generation_batch): on a GPU from 64, halved on each
    out-of-memory error down to what fits (16 here), every result kept in input order; on the CPU
    8 and an out-of-memory error is not retried. A fake `run` stands in for the model."""
    import torch

    from megatron_dllm.evaluation.generation_batches import in_batches

    fits, tried = 16, []

    def run(indices):
        tried.append(len(indices))
        if len(indices) > fits:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return [i * 10 for i in indices]

    lengths = [(7 * i) % 100 for i in range(100)]  # sorted order differs from the input order
    if device == "cpu":
        fits = 4
        with pytest.raises(torch.OutOfMemoryError):
            in_batches(lengths, "auto", torch.device(device), run)
        assert tried == [8]
        return
    assert in_batches(lengths, "auto", torch.device(device), run) == [i * 10 for i in range(100)]
    assert tried == [64, 32, *[16] * 6, 4]
