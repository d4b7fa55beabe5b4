"""The entry point end to end: real-text training on the embedded demo, and bad input."""
import glob
import math

import numpy as np
import pytest

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
    tokenizer = prepare_demo_corpus(demo_cache)["tokenizer_model"]
    proc, _ = pretrain(1, "--data-path", str(tmp_path / "nope"), "--tokenizer-type", "SentencePieceTokenizer",
                       "--tokenizer-model", tokenizer, "--train-iters", "1", check=False)
    assert f"--data-path: no dataset at prefix '{tmp_path / 'nope'}'" in _error(proc)


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
