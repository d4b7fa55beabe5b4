"""Hardened checkpoints: SIGKILL mid-training and during a save, then an exact resume; partial
saves (staged as iter_N.RUNID.incomplete) are removed on the next start; checkpoints (weights, EMA, optimizer state)
reshard between TP=2 and PP=2; the EMA is restored bit-identically on resume."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import REPO, TINY_RUN, launch_env, run_pretrain

from megatron_dllm.cli.chaos_resume import marked_processes, process_tree, running, signal_tree

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

BASE = [*TINY_RUN, "--eval-interval", "4", "--eval-iters", "1", "--train-iters", "8", "--save-interval", "2",
        "--ema-decay", "0.9"]
# the padded vocabularies differ (4352 at TP=2, 4224 at TP=1): resharding loads the common rows
TP2 = ["--tensor-model-parallel-size", "2"]
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


def _copy_checkpoint(src, iteration, dst):
    dst.mkdir()
    shutil.copytree(src / f"iter_{iteration:07d}", dst / f"iter_{iteration:07d}")
    (dst / TRACKER).write_text(str(iteration))


def _run_until(nproc: int, flags: list, workdir, metrics, condition, timeout: float = 180):
    """Start pretrain_dllm.py under torchrun and SIGKILL its whole tree as soon as `condition()`
    holds (polled every millisecond). Returns what `condition` returned, or None if it never held."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--standalone", os.path.join(REPO, "pretrain_dllm.py"), *flags,
           "--metrics-file", str(metrics)]
    env = launch_env(nproc)
    log = open(os.path.join(str(workdir), "killed-run.log"), "w")  # kept for a failing test's reader
    proc = subprocess.Popen(cmd, cwd=str(workdir), env=env, start_new_session=True, stdout=log, stderr=log)
    caught, deadline, tree = None, time.time() + timeout, []
    try:
        while proc.poll() is None and time.time() < deadline:
            caught = condition()
            if caught:
                break
            time.sleep(0.001)
    finally:
        if proc.poll() is None:
            tree = process_tree(proc.pid)
            signal_tree(proc.pid, signal.SIGKILL)  # a node failure: the whole tree at once
        proc.wait()
        log.close()
    # A killed rank holds its files, the output's lock among them, until it has exited, which can
    # take a while mid-save (a write to finish); the next job starts once the node's processes are
    # gone, as a scheduler's would: those of the tree when it was killed, and any forked after that
    # look (their command lines name this test's directory).
    gone_by = time.time() + 30
    while (any(running(p) for p in tree) or marked_processes(str(workdir))) and time.time() < gone_by:
        time.sleep(0.01)
    return caught


def _records(metrics) -> list:
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []


def test_sigkill_during_a_save_then_resume_is_bit_identical(full, demo_cache, tmp_path):
    full_ckpt, full_records = full
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "killed.jsonl"
    flags = ["--demo-cache-dir", demo_cache, *BASE, *TP2, "--save", str(ckpt), "--load", str(ckpt)]

    def saving():  # a save after the first finished checkpoint is under way (staged, not yet renamed)
        tracker = ckpt / TRACKER
        staged = sorted(ckpt.glob(f"iter_{int(tracker.read_text()) + 2:07d}.*.incomplete")) if tracker.exists() else []
        return staged[0] if staged else None

    partial = _run_until(2, flags, tmp_path, metrics, saving)
    assert partial is not None, "the run was never caught during a save"
    done = int((ckpt / TRACKER).read_text())
    assert done >= 2 and partial.exists() and not (ckpt / partial.name.split(".")[0]).exists()
    killed = [json_line for json_line in metrics.read_text().splitlines()]
    assert len(killed) >= done  # it trained past its last checkpoint

    proc, records = run_pretrain(2, flags, tmp_path)
    assert f"removed incomplete save {partial}" in proc.stdout and not partial.exists()
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
    proc, records = run_pretrain(2, base + PP2 + ["--train-iters", "4", "--load", str(a),
                                                  "--use-checkpoint-opt-param-scheduler"], tmp_path)
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


@pytest.mark.parametrize("family,nproc,layout", [pytest.param("esolm", 4, [*TP2, *PP2], id="esolm-tp2-pp2"),
                                                 pytest.param("duo", 2, TP2, id="duo-tp2")])
def test_sigkill_mid_training_resumes_exactly(family, nproc, layout, demo_cache, tmp_path):
    """SIGKILL between checkpoints, restart the same command, and the iterations the killed run had
    already done come out bit-identical (same data order, noise and optimizer state). Eso-LM (a
    shuffled order per sample) at TP=2 x PP=2 (4 ranks: every model-parallel dimension at once);
    Duo (uniform noise, RNG states not restored: --no-load-rng, since the noise is a function of
    (seed, sample), not of the generators' state) at TP=2, where its vocab-parallel loss is
    sharded: a second 4-rank kill proved nothing the Eso-LM one and Duo's PP=2 equivalence
    (test_parallel_equivalence) do not. MDLM's resume is covered by the kill during a save and by
    the chaos soak, and AR draws no noise."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    no_rng = ["--no-load-rng"] if family == "duo" else []
    flags = ["--demo-cache-dir", demo_cache, "--family", family, *BASE, *layout, "--train-iters", "6",
             "--save-interval", "3", "--eval-interval", "100", "--save", str(ckpt), "--load", str(ckpt), *no_rng]

    def past_checkpoint():  # iteration 3 saved and at least one more iteration logged
        done = (ckpt / TRACKER).exists() and (ckpt / TRACKER).read_text() == "3"
        return done and any(r.get("iteration", 0) > 3 and "loss" in r for r in _records(metrics))

    assert _run_until(nproc, flags, tmp_path, metrics, past_checkpoint), "never caught between checkpoints"
    killed = {r["iteration"]: (r["loss"], r["grad_norm"]) for r in _records(metrics) if "loss" in r}
    assert (ckpt / TRACKER).read_text() == "3" and max(killed) < 6

    proc, records = run_pretrain(nproc, flags, tmp_path)
    resumed = {r["iteration"]: (r["loss"], r["grad_norm"]) for r in records if "loss" in r}
    assert sorted(resumed) == [4, 5, 6]
    overlap = [i for i in resumed if i in killed]
    assert overlap and [resumed[i] for i in overlap] == [killed[i] for i in overlap]  # bit-identical
    assert ("RNG" in proc.stdout.split("loaded checkpoint")[1].splitlines()[0]) == (not no_rng)
    assert (ckpt / TRACKER).read_text() == "6"
