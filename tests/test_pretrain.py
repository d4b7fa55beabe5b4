"""The entry point end to end: real-text training on the embedded demo, and bad input."""
import glob
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, launch_env

from megatron_dllm.data.prep.dataset_writer import IndexedDatasetWriter
from megatron_dllm.data.prep.demo import prepare_demo_corpus

pytestmark = pytest.mark.slow


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", ["mdlm", "ar"])
def test_real_text_training_loss_falls_far_below_log_vocab(family, pretrain, tmp_path):
    iters = 40
    proc, records = pretrain(2, "--family", family, "--train-iters", str(iters), "--log-interval", "10",
                             "--eval-interval", "20", "--eval-iters", "2", "--save", str(tmp_path / "ckpt"),
                             "--load", str(tmp_path / "ckpt"))  # the resume idiom, with nothing to resume
    train = [r["loss"] for r in records if "loss" in r]
    valid = [r["valid_nelbo"] for r in records if "valid_nelbo" in r]
    log_vocab = math.log(4097)  # the demo tokenizer: 4096 pieces + [MASK]
    assert len(train) == iters // 10 and len(valid) == 2
    assert train[-1] < train[0] and valid[-1] < valid[0]
    assert valid[-1] < log_vocab - 2.0, (valid, log_vocab)  # NELBO (MDLM) / exact NLL (AR) in nats
    assert f"validation at iteration {iters}" in proc.stdout
    assert f"no checkpoint in {tmp_path / 'ckpt'}: starting from iteration 0" in proc.stdout
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == str(iters)
    assert glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))


@pytest.mark.multiprocess
def test_the_front_door_on_cpu_prints_only_the_runs_own_lines(demo_cache, tmp_path):
    """README command 1 on CPU, cut to 2 iterations and with Python's warnings shown, then run again
    (it resumes): megatron-core's Apex/TransformerEngine fallback warnings give way to one line
    naming the fused paths a CPU does without, and no other warning reaches the terminal."""
    env = launch_env(2)  # OMP_NUM_THREADS=1, as the README gives it (else torchrun announces it)
    env.pop("PYTHONWARNINGS")  # the tests' launcher silences warnings; here they are the subject
    env["CUDA_VISIBLE_DEVICES"] = ""
    for longer in ([], ["--train-iters", "3", "--override-opt-param-scheduler"]):  # run 2: one iteration more
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                               os.path.join(REPO, "pretrain_dllm.py"), "--family", "mdlm", "--demo-cache-dir",
                               demo_cache, "--train-iters", "2", "--eval-interval", "2", "--eval-iters", "1",
                               *longer],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = (proc.stdout + proc.stderr).splitlines()
        noise = [line for line in lines if "Warning" in line or "warnings.warn" in line or "Apex" in line
                 and not line.startswith("CPU run:") or "Transformer Engine" in line or "OMP_NUM_THREADS" in line]
        assert not noise, noise
        notes = [line for line in proc.stdout.splitlines()
                 if line.startswith("CPU run: megatron-core's fused CUDA paths")]
        assert len(notes) == 1, proc.stdout
        assert "TransformerEngine" in notes[0] and "Apex" in notes[0]
        assert proc.stderr == "", proc.stderr  # the run's own lines go to stdout; nothing else is printed
    assert "loaded checkpoint" in proc.stdout and "at iteration 2" in proc.stdout  # the second run resumed


def _error(proc) -> str:
    assert proc.returncode != 0
    return proc.stderr


def test_unknown_family(pretrain):
    proc, _ = pretrain(1, "--family", "sedd", check=False)
    assert "--family 'sedd' is not a known family; expected one of: ar, mdlm, duo, esolm" in _error(proc)


@pytest.mark.multiprocess
def test_tp_that_does_not_divide_heads(pretrain):
    proc, _ = pretrain(2, "--tensor-model-parallel-size", "2", "--hidden-size", "96",
                       "--num-attention-heads", "3", check=False)
    assert "--tensor-model-parallel-size 2 does not divide the number of attention heads 3" in _error(proc)


def test_missing_data_prefix(pretrain, demo_cache, tmp_path):
    """Rank 0 checks the prefixes first; its error is every rank's (rank 1 waited at a barrier rank 0
    never reached, and died there with a traceback)."""
    tokenizer = prepare_demo_corpus(demo_cache)["tokenizer_model"]
    proc, _ = pretrain(2, "--data-path", str(tmp_path / "nope"), "--tokenizer-type", "SentencePieceTokenizer",
                       "--tokenizer-model", tokenizer, "--train-iters", "1", check=False)
    assert _error(proc).count(f"error: --data-path: no dataset at prefix '{tmp_path / 'nope'}'") == 2
    assert "[rank1]: Traceback" not in proc.stderr


def test_an_unwritable_log_file_is_every_ranks_one_error(pretrain, tmp_path):
    """Only the last rank opens the log files; the others would wait for it in a collective."""
    (tmp_path / "file").write_text("")
    proc, _ = pretrain(2, "--family", "mdlm", "--train-iters", "1", "--tensorboard-dir", str(tmp_path / "file" / "tb"),
                       check=False)
    assert _error(proc).count(f"error: --tensorboard-dir {tmp_path / 'file' / 'tb'}: cannot write there") == 2
    assert "[rank0]: Traceback" not in proc.stderr and "[rank1]: Traceback" not in proc.stderr


def test_token_ids_beyond_the_vocabulary(pretrain, demo_cache, tmp_path):
    prefix = str(tmp_path / "other_tokenizer")
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        for i in range(60):  # ids 0..5999, as from a 6000-piece tokenizer
            writer.add_document(np.arange(i * 100, i * 100 + 100))
    tokenizer = prepare_demo_corpus(demo_cache)["tokenizer_model"]
    proc, _ = pretrain(1, "--data-path", prefix, "--split", "90,10,0", "--tokenizer-type",
                       "SentencePieceTokenizer", "--tokenizer-model", tokenizer, "--seq-length", "32",
                       "--train-iters", "1", check=False)
    assert f"{prefix}.bin holds token ids in [0, 5999]" in _error(proc)
    assert "vocab_size=4097" in proc.stderr


def test_a_log_line_gives_the_mean_loss_of_its_interval_as_megatron_lm(pretrain, tmp_path):
    """Megatron-LM's log line averages the loss over the iterations since the last one (a single
    iteration's loss is a noisy sample of the curve); the same run logged every iteration gives
    the reference."""
    from conftest import TINY_RUN

    runs = {}
    for interval in ("1", "3"):
        _, records = pretrain(1, "--family", "mdlm", *TINY_RUN, "--train-iters", "7", "--log-interval", interval,
                              "--save", str(tmp_path / f"every{interval}"))
        runs[interval] = {r["iteration"]: r["loss"] for r in records if "loss" in r}
    every = runs["1"]
    assert list(runs["3"]) == [3, 6, 7]
    for end, start in ((3, 1), (6, 4), (7, 7)):
        assert runs["3"][end] == pytest.approx(sum(every[i] for i in range(start, end + 1)) / (end - start + 1),
                                               rel=1e-12)
    # a run that exits between lines (--exit-interval, a signal, the time limit) logs the rest of its interval
    _, records = pretrain(1, "--family", "mdlm", *TINY_RUN, "--train-iters", "7", "--log-interval", "3",
                          "--exit-interval", "5", "--save", str(tmp_path / "exits"))
    exits = {r["iteration"]: r["loss"] for r in records if "loss" in r}
    assert list(exits) == [3, 5] and exits[5] == pytest.approx((every[4] + every[5]) / 2, rel=1e-12)
