"""`pretrain_dllm.py --sft`: epochs over the SFT rows, validation on held-out rows, and an exact
resume in the middle of an epoch (the second epoch's order included)."""
import json
import os
import shutil

import pytest
from conftest import REPO, launch_env, run_pretrain, run_python

pytestmark = pytest.mark.slow

TRACKER = "latest_checkpointed_iteration.txt"


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sft_data")


@pytest.fixture(scope="module")
def sft_data(demo_cache, task_dir):
    """80 arithmetic problems for training -> 72 train rows and 8 held-out rows (--split 90,10,0)."""
    from megatron_dllm.data.prep.arithmetic import write_task
    from megatron_dllm.data.prep.sft_preprocess import preprocess_sft
    from megatron_dllm.data.tokenizers import build_tokenizer

    work = task_dir
    tok_model = os.path.join(demo_cache, "shakespeare_bpe4096.model")
    task = write_task(str(work), max_operand=10, max_second=10, test_size=20)
    tokenizer = build_tokenizer("SentencePieceTokenizer", tok_model)
    preprocess_sft([task["train"]], str(work / "train_sft"), tokenizer, 48)
    return ["--sft", "--data-path", str(work / "train_sft"), "--split", "90,10,0",
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tok_model,
            "--preset", "cpu-tiny", "--num-layers", "2", "--seq-length", "48", "--micro-batch-size", "8",
            "--global-batch-size", "16", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "0",
            "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1"]


# 72 rows / 16 per batch: epoch 1 ends inside iteration 5; --train-epochs 1.2 -> ceil(86.4 / 16) = 6
RESUMABLE = ["--family", "esolm", "--train-epochs", "1.2", "--save-interval", "3"]


@pytest.fixture(scope="module")
def full_run(sft_data, tmp_path_factory):
    work = tmp_path_factory.mktemp("full")
    proc, records = run_pretrain(1, [*sft_data, *RESUMABLE, "--save", str(work / "ckpt")], work)
    return work, proc.stdout + proc.stderr, records


def test_resume_mid_epoch_is_exact(sft_data, full_run, tmp_path):
    work, log, full = full_run
    assert "6 iterations of 16 x 48 tokens" in log
    losses = {r["iteration"]: r["loss"] for r in full if "loss" in r}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    valid = [r["valid_nelbo"] for r in full if "valid_nelbo" in r]
    assert len(valid) == 2 and all(0 < v < 20 for v in valid)  # the MDLM bound on response tokens

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(work / "ckpt" / "iter_0000003", resumed / "ckpt" / "iter_0000003")
    (resumed / "ckpt" / TRACKER).write_text("3")
    ckpt = str(resumed / "ckpt")
    _, records = run_pretrain(1, [*sft_data, *RESUMABLE, "--load", ckpt, "--save", ckpt], resumed)
    again = {r["iteration"]: r["loss"] for r in records if "loss" in r}
    assert again == {i: losses[i] for i in (4, 5, 6)}  # bit for bit


def test_gsm8k_command_on_the_checkpoint(full_run, task_dir, tmp_path):
    """tools/evaluate.py gsm8k end to end on the fine-tuned checkpoint (the arithmetic test split
    is in GSM8K's JSONL format)."""
    work, _, _ = full_run
    preds = tmp_path / "pred.jsonl"
    proc = run_python([os.path.join(REPO, "tools", "evaluate.py"), "gsm8k", "--load", str(work / "ckpt"),
                       "--data", str(task_dir / "test.jsonl"), "--limit", "3", "--max-new-tokens", "6",
                       "--predictions", "pred.jsonl", "--seed", "5"], tmp_path, launch_env(1))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["problems"] == 3 and result["family"] == "esolm" and result["batch_size"] == 1
    settings = result["settings"]  # every setting that made the answers, its files by absolute path
    assert (settings["seed"], settings["predictions"], settings["use_ema"]) == (5, str(preds), False)
    assert settings["data"] == str(task_dir / "test.jsonl") and settings["tokenizer_type"] == "SentencePieceTokenizer"
    assert os.path.isfile(settings["tokenizer_model"])  # the one the checkpoint recorded
    records = [json.loads(line) for line in preds.read_text().splitlines()]
    assert len(records) == 3 and result["generated_tokens"] == sum(r["generated_tokens"] for r in records)
    assert records[0]["prompt"].startswith("Question: What is ")
    from megatron_dllm.cli.evaluate import build_parser

    args = build_parser().parse_args(["gsm8k", "--load", str(tmp_path / "nothing")])
    with pytest.raises(FileNotFoundError, match="no such checkpoint or HF directory"):
        args.func(args)  # main() prints it as one error line, exit code 2


def test_evaluate_nelbo_on_the_checkpoint_is_the_logged_sft_validation(sft_data, full_run, task_dir, tmp_path):
    """An SFT dataset is scored as --sft validation scores it (response tokens only), not as text."""
    work, _, records = full_run
    logged = [r["valid_nelbo"] for r in records if "valid_nelbo" in r][-1]  # at iteration 6, the checkpoint's
    proc = run_python([os.path.join(REPO, "tools", "evaluate.py"), "nelbo", "--load", str(work / "ckpt"),
                       "--data-path", str(task_dir / "train_sft"), "--split", "90,10,0", "--global-batch-size",
                       "16", "--eval-iters", "1"], tmp_path, launch_env(1))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["nelbo"] == pytest.approx(logged, rel=1e-5)


def test_bad_combinations_are_named(demo_cache, sft_data):
    from megatron_dllm.config import parse_args, parse_flags
    from megatron_dllm.training.inputs import prepare_inputs

    with pytest.raises(ValueError, match="--train-epochs applies to --sft runs"):
        prepare_inputs(parse_flags(["--demo-cache-dir", demo_cache, "--train-epochs", "1"]))
    with pytest.raises(ValueError, match="--sft needs --data-path"):
        prepare_inputs(parse_flags(["--demo-cache-dir", demo_cache, "--sft", "--train-epochs", "1"]))
    with pytest.raises(ValueError, match="holds rows of 48 tokens, but --seq-length is 64"):
        prepare_inputs(parse_args([*sft_data, "--seq-length", "64", "--train-epochs", "1"]))
    with pytest.raises(ValueError, match=r"train_sft is an SFT dataset \(tools/preprocess_sft_data.py\); fine-tune "
                                         r"on it with --sft"):  # read as text, its prompts would be trained on
        prepare_inputs(parse_args([a for a in sft_data if a != "--sft"] + ["--train-iters", "1"]))
