"""Hardened checkpoints: SIGKILL mid-training and during a save, then an exact resume; partial
iteration directories are removed on the next start; checkpoints (weights, EMA, optimizer state)
reshard between TP=2 and PP=2; the EMA is restored bit-identically on resume."""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO, _free_port, run_pretrain

BASE = ["--preset", "cpu-tiny", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--lr-warmup-iters", "0", "--log-interval", "1", "--eval-interval", "4", "--eval-iters", "1",
        "--train-iters", "8", "--save-interval", "2", "--ema-decay", "0.9"]
# the padded vocabulary (a multiple of divisible-by x TP) must be the same in both layouts: 4224
TP2 = ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"]
PP2 = ["--pipeline-model-parallel-size", "2"]
TRACKER = "latest_checkpointed_iteration.txt"


def _losses(records, after=0):
    return [r["loss"] for r in records if "loss" in r and r["iteration"] > after]


def _valid(records, iteration):
    return [r["valid_nelbo"] for r in records if "valid_nelbo" in r and r["iteration"] == iteration]


def _tensors(path) -> dict:
    """All tensors of a torch_dist checkpoint directory, unsharded, without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = str(path) + ".pt"
    dcp_to_torch_save(str(path), out)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def full(demo_cache, tmp_path_factory):
    """The uninterrupted TP=2 run: checkpoints every 2 iterations, validation at 4 and 8."""
    work = tmp_path_factory.mktemp("full")
    _, records = run_pretrain(2, ["--demo-cache-dir", demo_cache, *BASE, *TP2, "--save", str(work / "ckpt")], work)
    return work / "ckpt", records


def _kill_tree(pid: int) -> None:
    """SIGKILL torchrun and its workers (which torchrun starts in sessions of their own), as a
    node failure would: every process group in the tree at once."""
    tree, todo = [pid], [pid]
    while todo:
        for task in os.listdir(f"/proc/{todo[0]}/task") if os.path.exists(f"/proc/{todo[0]}") else []:
            with open(f"/proc/{todo[0]}/task/{task}/children") as f:
                kids = [int(k) for k in f.read().split()]
            tree += kids
            todo += kids
        todo.pop(0)
    for group in {os.getpgid(p) for p in tree if os.path.exists(f"/proc/{p}")}:
        os.killpg(group, signal.SIGKILL)


def _copy_checkpoint(src, iteration, dst):
    dst.mkdir()
    shutil.copytree(src / f"iter_{iteration:07d}", dst / f"iter_{iteration:07d}")
    (dst / TRACKER).write_text(str(iteration))


def test_sigkill_during_a_save_then_resume_is_bit_identical(full, demo_cache, tmp_path):
    full_ckpt, full_records = full
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "killed.jsonl"
    flags = ["--demo-cache-dir", demo_cache, *BASE, *TP2, "--save", str(ckpt), "--load", str(ckpt)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={_free_port()}",
           os.path.join(REPO, "pretrain_dllm.py"), *flags, "--metrics-file", str(metrics)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(cmd, cwd=str(tmp_path), env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial, deadline = None, time.time() + 120
    try:  # kill the whole process group while a save after the first checkpoint is under way
        while proc.poll() is None and time.time() < deadline:
            tracker = ckpt / TRACKER
            if tracker.exists() and (ckpt / f"iter_{int(tracker.read_text()) + 2:07d}").exists():
                partial = ckpt / f"iter_{int(tracker.read_text()) + 2:07d}"
                _kill_tree(proc.pid)
                break
            time.sleep(0.001)
    finally:
        if proc.poll() is None and partial is None:
            _kill_tree(proc.pid)
        proc.wait()
    assert partial is not None, "the run was never caught during a save"
    done = int((ckpt / TRACKER).read_text())
    assert done >= 2 and partial.exists()
    killed = [json_line for json_line in metrics.read_text().splitlines()]
    assert len(killed) >= done  # it trained past its last checkpoint

    proc, records = run_pretrain(2, flags, tmp_path)
    assert f"removed partial checkpoint {partial}" in proc.stdout
    assert f"loaded checkpoint {ckpt / f'iter_{done:07d}'} at iteration {done}: weights, optimizer, RNG, EMA" \
        in proc.stdout
    assert _losses(records) == _losses(full_records, after=done)  # bit-identical on CPU fp32
    assert (ckpt / TRACKER).read_text() == "8"

    # the EMA (and the weights) at the end are bit-identical to the uninterrupted run's
    ours, theirs = _tensors(ckpt / "iter_0000008"), _tensors(full_ckpt / "iter_0000008")
    ema_keys = [k for k in theirs if k.startswith("ema.")]
    assert "ema.embedding.word_embeddings.weight" in ema_keys and "ema.layers.1.mlp.linear_fc2.weight" in ema_keys
    for key in ema_keys + [k[len("ema."):] for k in ema_keys]:
        if isinstance(theirs[key], torch.Tensor):
            assert torch.equal(ours[key], theirs[key]), key
    w, e = theirs["final_layer.output_layer.weight"], theirs["ema.final_layer.output_layer.weight"]
    assert not torch.equal(w, e)  # an average, not a copy


def test_checkpoints_reshard_between_tp2_and_pp2(full, demo_cache, tmp_path):
    full_ckpt, full_records = full
    base = ["--demo-cache-dir", demo_cache, *BASE]
    # TP=2 -> PP=2 at iteration 4 == --train-iters: the loaded run only evaluates
    a = tmp_path / "a"
    _copy_checkpoint(full_ckpt, 4, a)
    proc, records = run_pretrain(2, base + PP2 + ["--train-iters", "4", "--load", str(a)], tmp_path)
    assert "evaluating only" in proc.stdout and not _losses(records)
    assert _valid(records, 4) == pytest.approx(_valid(full_records, 4), rel=1e-5)

    # TP=2 -> PP=2 at iteration 6, then training continues (model, optimizer, schedule, EMA)
    b = tmp_path / "b"
    _copy_checkpoint(full_ckpt, 6, b)
    proc, records = run_pretrain(2, base + PP2 + ["--load", str(b), "--save", str(b)], tmp_path)
    assert "not restoring RNG states" in proc.stdout
    assert _losses(records) == pytest.approx(_losses(full_records, after=6), rel=1e-5)
    assert _valid(records, 8) == pytest.approx(_valid(full_records, 8), rel=1e-5)

    # PP=2 -> TP=2: the checkpoint the PP=2 run saved at iteration 8 evaluates the same under TP=2
    proc, back = run_pretrain(2, base + TP2 + ["--load", str(b)], tmp_path)
    assert _valid(back, 8) == pytest.approx(_valid(records, 8), rel=1e-5)
