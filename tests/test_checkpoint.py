"""Checkpoints through megatron-core dist_checkpointing: resume continues the run exactly, and a
checkpoint of another family is refused with both sides named."""
import shutil

import pytest
from conftest import TINY_RUN

pytestmark = pytest.mark.slow

RUN = [*TINY_RUN, "--eval-interval", "100", "--train-iters", "4"]


def _losses(records):
    return [r["loss"] for r in records if "loss" in r]


BD3LM = ["--family", "bd3lm", "--block-size", "8", "--noise", "uniform"]


# (TP=2 and PP=2 resume with real kills in test_resume.py)
@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [["--use-distributed-optimizer"], BD3LM], ids=["DP2-distopt", "DP2-bd3lm"])
def test_resume_continues_bit_identically(layout, pretrain, tmp_path):
    full = tmp_path / "full"
    _, records = pretrain(2, *RUN, *layout, "--save", str(full), "--save-interval", "2")
    uninterrupted = _losses(records)
    assert (full / "latest_checkpointed_iteration.txt").read_text() == "4"

    resumed = tmp_path / "resumed"  # the same run stopped after its iteration-2 checkpoint
    resumed.mkdir()
    shutil.copytree(full / "iter_0000002", resumed / "iter_0000002")
    (resumed / "latest_checkpointed_iteration.txt").write_text("2")
    _, records = pretrain(2, *RUN, *layout, "--load", str(resumed), "--save", str(resumed))
    assert _losses(records) == uninterrupted[2:]  # bit-identical on CPU fp32
    if "--use-distributed-optimizer" in layout:  # its state reshards across DP only: named, not a KeyError
        proc, _ = pretrain(2, *RUN, *layout, "--tensor-model-parallel-size", "2", "--load", str(full),
                           "--ckpt-step", "2", check=False)
        assert proc.returncode != 0 and "(saved at TP=1, PP=1; this run TP=2, PP=1)" in proc.stderr
        # across DP it reshards: DP=2 -> DP=1 continues the run (to rounding: another reduction order)
        _, records = pretrain(1, *RUN, *layout, "--load", str(full), "--ckpt-step", "2", "--save",
                              str(tmp_path / "dp1"))
        assert _losses(records) == pytest.approx(uninterrupted[2:], rel=1e-5)
    if layout == BD3LM:  # the block size is part of what the weights mean: another one is refused
        proc, _ = pretrain(1, *RUN, *BD3LM[:2], "--block-size", "4", "--load", str(resumed), check=False)
        assert proc.returncode != 0
        assert ("family_options: checkpoint {'block_size': 8, 'noise': 'uniform'} vs this run "
                "{'block_size': 4, 'noise': 'mask'}") in proc.stderr


def test_checkpoint_of_another_family_is_refused(pretrain, tmp_path):
    ckpt = tmp_path / "ckpt"
    pretrain(1, *RUN, "--family", "mdlm", "--train-iters", "1", "--save", str(ckpt))
    new = tmp_path / "new"  # a --save made for the refused run is not left behind, empty
    proc, _ = pretrain(1, *RUN, "--family", "ar", "--hidden-size", "96", "--load", str(ckpt), "--save", str(new),
                       check=False)
    assert proc.returncode == 2  # every difference is named
    assert "family: checkpoint 'mdlm' vs this run 'ar'; hidden_size: checkpoint 64 vs this run 96" in proc.stderr
    assert not new.exists() and (ckpt / "iter_0000001").is_dir()


def test_switching_the_data_mix_on_resume(pretrain, demo_cache, tmp_path):
    """Phase 1 -> phase 2: resuming with another --data-path reads the new mix from its start."""
    from megatron_dllm.data.prep.demo import prepare_demo_corpus

    demo = prepare_demo_corpus(demo_cache)
    data = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", demo["tokenizer_model"],
            "--valid-data-path", demo["valid_prefix"]]
    ckpt = tmp_path / "ckpt"
    pretrain(1, *RUN, *data, "--data-path", demo["data_prefix"], "--train-iters", "2", "--save", str(ckpt))
    phase2 = ["--data-path", "0.5", demo["data_prefix"], "0.5", demo["valid_prefix"]]
    proc, records = pretrain(1, *RUN, *data, *phase2, "--load", str(ckpt), "--save", str(ckpt),
                             "--override-opt-param-scheduler")  # phase 2 decays the LR over 4 iterations
    assert "data mix changed at iteration 2" in proc.stdout
    assert [r["consumed_samples"] for r in records if "loss" in r] == [24, 32]
    proc, _ = pretrain(1, *RUN, *data, *phase2, "--train-iters", "5", "--load", str(ckpt), "--save", str(ckpt),
                       "--override-opt-param-scheduler")
    assert "data mix changed" not in proc.stdout  # the switch is remembered in the checkpoint


def test_other_optimizer_flags_on_resume_are_refused_or_applied(pretrain, demo_cache, tmp_path):
    """A flag of the LR schedule, weight decay or Adam changed on resume is refused in one line;
    --override-opt_param-scheduler continues as a run that had the new flags from the start,
    --use-checkpoint-opt-param-scheduler as the run that saved (param groups, LR and weight decay
    of the first resumed step included)."""
    from megatron_dllm import platform
    from megatron_dllm.checkpoint import CheckpointError
    from megatron_dllm.config import parse_args
    from megatron_dllm.training.trainer import Trainer

    ckpt = tmp_path / "ckpt"
    pretrain(1, *RUN, "--save", str(ckpt), "--save-interval", "2")
    load = ["--load", str(ckpt), "--ckpt-step", "2"]
    new = ["--lr", "1e-4", "--weight-decay", "0.05", "--adam-beta2", "0.99", "--adam-eps", "1e-6", "--train-iters", "6"]

    def optimizer_state(*flags, steps=0):
        out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"  # never the demo's default --save in the cwd
        try:
            trainer = Trainer(parse_args([*RUN, "--demo-cache-dir", demo_cache, *flags, "--save", str(out / "ckpt"),
                                          "--tensorboard-dir", str(out / "tb")]))
            trainer.scheduler.step(increment=steps)
            return [(g["lr"], g["weight_decay"], g["betas"], g["eps"], g["max_lr"])
                    for g in trainer.optimizer.optimizer.param_groups], trainer.scheduler.num_steps
        finally:
            platform.destroy_distributed()

    with pytest.raises(CheckpointError, match=r"--lr 0.0001 \(checkpoint 0.001\); .* --adam-eps 1e-06 "
                                              r"\(checkpoint 1e-08\); give --override-opt-param-scheduler"):
        optimizer_state(*new, *load)
    assert optimizer_state(*new, *load, "--override-opt_param-scheduler") == optimizer_state(*new, steps=2)
    uninterrupted = optimizer_state(*load)
    assert uninterrupted[0][0][1:4] == (0.1, (0.9, 0.95), 1e-8)
    assert optimizer_state(*new, *load, "--use-checkpoint-opt-param-scheduler") == uninterrupted


def test_a_smaller_global_batch_on_resume_is_refused_before_it_runs_out_of_samples(pretrain, demo_cache, tmp_path):
    """A weighted mix holds exactly --train-iters x --global-batch-size samples: the samples
    consumed at a larger batch leave too few for the rest of the run."""
    from megatron_dllm.data.prep.demo import prepare_demo_corpus

    demo = prepare_demo_corpus(demo_cache)
    data = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", demo["tokenizer_model"],
            "--data-path", "0.5", demo["data_prefix"], "0.5", demo["data_prefix"], "--valid-data-path",
            demo["valid_prefix"], "--lr-decay-iters", "4"]
    ckpt = tmp_path / "ckpt"
    pretrain(1, *RUN, *data, "--train-iters", "2", "--save", str(ckpt))
    proc, _ = pretrain(1, *RUN, *data, "--global-batch-size", "4", "--load", str(ckpt), check=False)
    assert proc.returncode == 2
    assert (f"--load {ckpt / 'iter_0000002'}: 16 samples consumed by iteration 2 and 2 more iterations of "
            f"--global-batch-size 4 need 24 training samples; the training set holds 16") in proc.stderr
    proc, records = pretrain(1, *RUN, *data, "--global-batch-size", "16", "--load", str(ckpt))  # a larger one fits
    assert [r["consumed_samples"] for r in records if "loss" in r] == [32, 48]


def test_no_load_optim_and_finetune(pretrain, tmp_path):
    full = tmp_path / "full"
    _, records = pretrain(1, *RUN, "--save", str(full), "--save-interval", "2")
    uninterrupted = _losses(records)
    part = tmp_path / "part"  # the run's iteration-2 checkpoint
    part.mkdir()
    shutil.copytree(full / "iter_0000002", part / "iter_0000002")
    (part / "latest_checkpointed_iteration.txt").write_text("2")

    # --no-load-optim: the weights load, so iteration 3's loss (computed before any update) is the
    # uninterrupted one; the fresh AdamW state then makes iteration 4 differ.
    proc, records = pretrain(1, *RUN, "--load", str(part), "--no-load-optim", "--save", str(tmp_path / "a"))
    losses = _losses(records)
    assert losses[0] == uninterrupted[2] and losses[1] != uninterrupted[3]

    # --finetune: weights only; the run starts over at sample 0, where the trained weights fit the
    # same samples and noise better than the untrained model did at its iteration 1.
    proc, records = pretrain(1, *RUN, "--load", str(part), "--finetune", "--train-iters", "1",
                             "--save", str(tmp_path / "b"))
    assert [r["consumed_samples"] for r in records if "loss" in r] == [8]
    assert _losses(records)[0] < uninterrupted[0]
    assert "weights only (--finetune)" in proc.stdout
