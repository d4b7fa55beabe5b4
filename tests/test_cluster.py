"""Running on a cluster, end to end on the demo corpus (one process each):

- SIGTERM mid-run: the iteration finishes, a checkpoint is saved, exit 0; the re-launch from the
  run's resolved config continues bit-identically to an uninterrupted run, and its asynchronous
  saves hold the same bytes as the uninterrupted run's synchronous ones;
- --exit-duration-in-mins stops and saves;
- a SIGKILL during an asynchronous save leaves no checkpoint that loads as complete;
- retention keeps exactly the expected checkpoints, and the start-of-run size estimate matches;
- TensorBoard scalars carry Megatron-LM's names, a W&B offline run holds the same scalars, and
  a torch profiler trace appears;
- injected non-finite gradients are skipped and logged, and K in a row stop the run after a save;
- a signal or a non-finite loss seen by one rank stops or skips on every rank;
- selective and full (uniform, block) recompute equal no recompute.
"""
import glob
import json
import os
import pickle
import re
import signal
import struct
import time

import pytest
import torch
from conftest import REPO, REPO_PYTHONPATH, TINY_RUN, popen_python, run_pretrain, run_python, run_worker_on_two_ranks

pytestmark = pytest.mark.slow

BASE = [*TINY_RUN, "--eval-interval", "4", "--eval-iters", "1", "--train-iters", "8"]
TRACKER = "latest_checkpointed_iteration.txt"
PRETRAIN = os.path.join(REPO, "pretrain_dllm.py")


def _losses(records, after=0):
    return [r["loss"] for r in records if "loss" in r and r["iteration"] > after]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "RANK": "0", "LOCAL_RANK": "0",
            "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}


def _start(flags, workdir, metrics, script=PRETRAIN, env=None):
    """One training process in a session of its own (its checkpoint writer too)."""
    log = open(os.path.join(str(workdir), "run.log"), "w")
    proc = popen_python([script, *flags, "--metrics-file", str(metrics)], workdir, {**_env(), **(env or {})}, log,
                        start_new_session=True)
    return proc, log


def _records(metrics):
    return [json.loads(line) for line in open(metrics)] if os.path.exists(metrics) else []


def _wait_for(proc, condition, timeout=180):
    deadline = time.time() + timeout
    while proc.poll() is None and time.time() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.001)
    return None


@pytest.fixture(scope="module")
def full(demo_cache, tmp_path_factory):
    """The uninterrupted run (synchronous saves every 2 iterations), with retention, the
    profiler and W&B offline."""
    work = tmp_path_factory.mktemp("full")
    flags = ["--demo-cache-dir", demo_cache, *BASE, "--save", str(work / "ckpt"), "--save-interval", "2",
             "--keep-last-n-checkpoints", "1", "--keep-checkpoint-interval", "4",
             "--tensorboard-dir", str(work / "tb"), "--profile", "--profile-step-start", "2", "--profile-step-end", "4",
             "--wandb-project", "dllm-tests", "--wandb-exp-name", "full", "--wandb-save-dir", str(work / "wandb")]
    saved = {k: os.environ.get(k) for k in ("WANDB_MODE", "WANDB_SILENT")}
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
    try:
        proc, records = run_pretrain(1, flags, work)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return work, proc, records


def test_retention_keeps_exactly_the_newest_and_every_kth(full):
    work, proc, _ = full
    ckpt = work / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iter_")) == ["iter_0000004", "iter_0000008"]
    for removed in ("iter_0000002", "iter_0000006"):
        assert f"removed checkpoint {ckpt / removed} (--keep-last-n-checkpoints 1, --keep-checkpoint-interval 4)" \
            in proc.stdout


def test_the_start_of_run_size_estimate_matches_the_checkpoints_on_disk(full):
    from megatron_dllm.checkpoint.manifest import manifest_size

    work, proc, _ = full
    m = re.search(r"checkpoints: about ([\d.e+-]+) GiB each \(([\d,]+) parameters\); up to (\d+) in", proc.stdout)
    assert m, proc.stdout[:2000]
    actual = manifest_size(str(work / "ckpt" / "iter_0000008"))
    assert abs(float(m.group(1)) * 2**30 / actual - 1) < 0.05, (m.group(0), actual)
    assert int(m.group(3)) == 4  # saves at 2, 4, 6, 8: never more than 4 on disk


def test_log_lines_carry_mfu_memory_phase_times_and_eta(full):
    _, proc, records = full
    assert "MFU" not in proc.stdout  # a CPU has no peak FLOP/s: nothing about MFU at all
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(" iteration       8/8"))
    assert re.search(r"FLOPs [\d.e+]+ \| peak memory [\d.]+ GiB \(CPU RSS peak\) \| ms per iteration: data "
                     r"[\d.]+, forward-backward [\d.]+, grads-sync [\d.]+, optimizer [\d.]+ \| ETA 00:00:00",
                     line), line  # no MFU where there is no peak to compare with
    last = [r for r in records if "loss" in r][-1]
    assert last["peak_memory_bytes"] > 2**20 and last["forward-backward_ms"] > 0 and "mfu" not in last


def test_tensorboard_scalars_use_megatron_lm_names(full):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    work, _, records = full
    events = EventAccumulator(str(work / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm loss", "lm loss vs samples", "learning-rate", "grad-norm", "throughput", "iteration-time",
            "mem-max-allocated-bytes", "forward-backward-time", "optimizer-time", "lm loss validation",
            "lm loss validation ppl"} <= tags, tags
    logged = [e.value for e in events.Scalars("lm loss")]
    assert logged == pytest.approx(_losses(records), rel=1e-6)
    assert [e.step for e in events.Scalars("lm loss vs samples")] == [8 * i for i in range(1, 9)]


def _wandb_records(path):
    """The protobuf records of a .wandb file, read independently of wandb's own reader: a
    7-byte header (':W&B', version), then LevelDB-log blocks of 32 KiB whose chunks (crc32,
    length, type FULL=1/FIRST=2/MIDDLE=3/LAST=4) carry the records."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, pending, records = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_a_wandb_offline_run_holds_the_scalars_and_the_resolved_config(full):
    work, _, records = full
    (path,) = glob.glob(str(work / "wandb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    history, config = {}, {}

    def items(entries):  # a key is either `key` or (newer writers) the path `nested_key`
        return {e.key or "/".join(e.nested_key): json.loads(e.value_json) for e in entries}

    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.setdefault(record.history.step.num, {}).update(items(record.history.item))
        elif kind in ("run", "config"):  # the config comes with the run record, updates after it
            config.update(items((record.run.config if kind == "run" else record.config).update))
    assert [history[s]["lm loss"] for s in range(1, 9)] == pytest.approx(_losses(records), rel=1e-12)
    assert history[8]["lm loss validation"] == pytest.approx([r for r in records if "valid_nelbo" in r][-1]
                                                              ["valid_nelbo"])
    assert config["checkpoint"]["keep-last-n-checkpoints"] == 1 and config["model"]["preset"] == "cpu-tiny"


def test_the_profiler_writes_a_trace_of_the_profiled_iterations(full):
    work, proc, _ = full
    (trace,) = glob.glob(str(work / "tb" / "rank0*.pt.trace.json"))
    events = json.load(open(trace))["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)
    assert f"wrote torch profiler trace of iterations 2-3 into {work / 'tb'}" in proc.stdout


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def _files(directory):
    """Every file's bytes (the shards: .distcp), except two pickles compared by content: torch's
    .metadata, whose storage_meta holds a random id per save, and megatron's common.pt, whose
    byte layout depends on which equal strings happen to be one object (pickle's memo) -- the
    relaunched run reads its paths from YAML. In the shards, each rank's writer record (the id
    of the run that saved it, `checkpoint/writers.py`) is blanked out."""
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_dllm.checkpoint.writers import RECORD_KEY

    records = {}
    for index, info in FileSystemReader(str(directory)).read_metadata().storage_data.items():
        if index.fqn.startswith(RECORD_KEY + "/"):
            records.setdefault(info.relative_path, []).append((info.offset, info.length))
    out = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name == ".metadata":
            meta = pickle.load(open(path, "rb"))
            out[name] = (meta.state_dict_metadata, meta.storage_data, meta.planner_data, meta.version)
        elif name == "common.pt":
            out[name] = torch.load(path, weights_only=False)
        elif name != "manifest.json":  # hashes of the above
            data = bytearray(open(path, "rb").read())
            for offset, length in records.get(name, []):
                data[offset:offset + length] = bytes(length)
            out[name] = bytes(data)
    return out


def test_sigterm_saves_and_exits_0_and_the_relaunch_from_the_resolved_config_is_bit_identical(
        full, demo_cache, tmp_path):
    full_work, _, full_records = full
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "sigterm.jsonl"
    flags = ["--demo-cache-dir", demo_cache, *BASE, "--save", str(ckpt), "--load", str(ckpt),
             "--save-interval", "100", "--exit-signal-handler", "--async-save"]
    proc, log = _start(flags, tmp_path, metrics)
    try:
        assert _wait_for(proc, lambda: len(_records(metrics)) >= 2), "the run never reached iteration 2"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    out = (tmp_path / "run.log").read_text()
    stopped = int((ckpt / TRACKER).read_text())
    assert 2 <= stopped < 8, out
    assert f"exiting after iteration {stopped}: received SIGTERM" in out
    assert f"saved checkpoint {ckpt / f'iter_{stopped:07d}'}" in out
    assert [r["iteration"] for r in _records(metrics) if "loss" in r] == list(range(1, stopped + 1))

    # the re-launch: nothing but the resolved configuration the run wrote beside its checkpoints
    relaunch, records = run_pretrain(1, ["--yaml-cfg", str(ckpt / "run_config.yaml")], tmp_path)
    assert f"loaded checkpoint {ckpt / f'iter_{stopped:07d}'} at iteration {stopped}" in relaunch.stdout
    assert _losses(records) == _losses(full_records, after=stopped)  # bit-identical on CPU fp32
    assert "writing checkpoint" in relaunch.stdout and (ckpt / TRACKER).read_text() == "8"
    # the asynchronous save of iteration 8 holds the same bytes as the synchronous one
    ours, theirs = _files(ckpt / "iter_0000008"), _files(full_work / "ckpt" / "iter_0000008")
    assert sorted(ours) == sorted(theirs) and any(n.endswith(".distcp") for n in ours)
    for name in theirs:
        assert _equal(ours[name], theirs[name]), name


def test_exit_duration_stops_and_saves(demo_cache, tmp_path):
    ckpt = tmp_path / "ckpt"
    proc, records = run_pretrain(1, ["--demo-cache-dir", demo_cache, *BASE, "--save", str(ckpt),
                                     "--exit-duration-in-mins", "0.001"], tmp_path)
    assert re.search(r"exiting after iteration 1: --exit-duration-in-mins 0.001 reached \([\d.]+ min up\)",
                     proc.stdout)
    assert (ckpt / TRACKER).read_text() == "1" and (ckpt / "iter_0000001" / "manifest.json").exists()
    assert [r["iteration"] for r in records if "loss" in r] == [1]


def test_sigkill_during_an_async_save_never_leaves_a_checkpoint_that_loads_as_complete(demo_cache, tmp_path):
    from megatron_dllm.checkpoint import layout
    from megatron_dllm.checkpoint.manifest import verify_manifest

    ckpt = tmp_path / "ckpt"
    flags = ["--demo-cache-dir", demo_cache, *BASE, "--save", str(ckpt), "--load", str(ckpt),
             "--save-interval", "1", "--async-save"]

    def writing():  # a background save under way after a completed one (the tracker read first)
        done = int((ckpt / TRACKER).read_text()) if (ckpt / TRACKER).exists() else None
        staged = [p for p in glob.glob(str(ckpt / "iter_*.incomplete"))
                  if done is not None and int(os.path.basename(p)[len("iter_"):].split(".")[0]) > done]
        return staged[0] if staged else None

    def caught():  # the run stopped (the rank and its forked writer) while `writing` still holds
        if not writing():
            return None
        os.killpg(proc.pid, signal.SIGSTOP)
        staged = writing()  # the save may have finished between the two looks
        if staged is None:
            os.killpg(proc.pid, signal.SIGCONT)
        return staged

    proc, log = _start(flags, tmp_path, tmp_path / "killed.jsonl")
    try:
        staged = _wait_for(proc, caught)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the rank and its forked checkpoint writer
        proc.wait()
        log.close()
    assert staged is not None, "the run was never caught during a save"
    found = layout.find_checkpoint(str(ckpt))
    assert found.path != os.path.join(os.path.dirname(staged), os.path.basename(staged).split(".")[0])
    for path in layout.iterations(str(ckpt)).values():  # every final name is complete
        verify_manifest(path)
    assert layout.incomplete_saves(str(ckpt))  # what the next start removes


def test_non_finite_gradients_are_skipped_and_k_in_a_row_stop_after_a_save(demo_cache, tmp_path):
    from megatron_dllm.checkpoint.meta import CheckpointMeta

    ckpt, metrics = tmp_path / "ckpt", tmp_path / "nan.jsonl"
    flags = ["--demo-cache-dir", demo_cache, *BASE, "--save", str(ckpt),  # the guard is on by default
             "--max-consecutive-nonfinite-iters", "2"]
    proc, log = _start(flags, tmp_path, metrics, script=os.path.join(REPO, "tests", "nonfinite_worker.py"),
                       env={"NONFINITE_ITERATIONS": "3,5,6", "PYTHONPATH": REPO_PYTHONPATH})
    code = proc.wait(timeout=300)
    log.close()
    out = (tmp_path / "run.log").read_text()
    assert code == 3, out[-3000:]
    assert "iteration 3: non-finite loss or gradient; step skipped (1 in a row, 1 in this run)" in out
    assert "iteration 6: non-finite loss or gradient; step skipped (2 in a row, 3 in this run)" in out
    assert ("error: 2 consecutive iterations with a non-finite loss or gradient (up to iteration 6, "
            "--max-consecutive-nonfinite-iters 2); the last good weights and optimizer state are saved at "
            "iteration 6") in out
    lines = metrics.read_text().splitlines()  # strict JSON: a non-finite value is null, never NaN
    assert [json.loads(line, parse_constant=pytest.fail) for line in lines] == _records(metrics)
    grad_norms = {r["iteration"]: r["grad_norm"] for r in _records(metrics) if "loss" in r}
    assert grad_norms[3] is None and grad_norms[5] is None
    assert all(isinstance(grad_norms[i], float) for i in (1, 2, 4))
    assert (ckpt / TRACKER).read_text() == "6"
    meta = CheckpointMeta.read(str(ckpt / "iter_0000006"))
    assert meta.scheduler["num_steps"] == 3  # iterations 1, 2 and 4 stepped
    assert meta.consumed_samples == 6 * 8  # skipped batches are consumed


def test_a_log_lines_mean_loss_leaves_skipped_iterations_out_and_counts_them(demo_cache, tmp_path):
    """Megatron-LM's log line: the mean loss of the iterations that stepped, and how many were
    skipped; the same run logged every iteration gives the reference (a skipped one's loss: null)."""
    runs = {}
    for interval in ("1", "4"):
        workdir = tmp_path / interval
        workdir.mkdir()
        flags = ["--demo-cache-dir", demo_cache, *BASE, "--log-interval", interval, "--save", str(workdir / "ckpt")]
        proc, log = _start(flags, workdir, workdir / "m.jsonl",
                           script=os.path.join(REPO, "tests", "nonfinite_worker.py"),
                           env={"NONFINITE_ITERATIONS": "2,3", "PYTHONPATH": REPO_PYTHONPATH})
        assert proc.wait(timeout=300) == 0, (workdir / "run.log").read_text()[-3000:]
        log.close()
        runs[interval] = {r["iteration"]: r for r in _records(workdir / "m.jsonl") if "loss" in r}
    every, four = runs["1"], runs["4"]
    assert every[2]["loss"] is None and every[2]["grad_norm"] is None and every[2]["skipped_iterations"] == 1
    assert four[4]["loss"] == pytest.approx((every[1]["loss"] + every[4]["loss"]) / 2, rel=1e-12)
    assert four[4]["skipped_iterations"] == 2 and "skipped_iterations" not in four[8]
    assert four[8]["loss"] == pytest.approx(sum(every[i]["loss"] for i in range(5, 9)) / 4, rel=1e-12)


def test_a_signal_or_a_nan_loss_on_one_rank_stops_or_skips_on_every_rank(tmp_path):
    rank0, rank1 = run_worker_on_two_ranks("exit_decision_worker.py", tmp_path)
    assert rank0["before_signal"] is None and rank1["before_signal"] is None
    assert rank0["after_signal"] == "received a signal (on another rank)"
    assert rank1["after_signal"] == "received SIGUSR1"
    assert rank0["any_rank"] == rank1["any_rank"] == [True, True, False]
    assert rank0["finite_norm"] == rank1["finite_norm"] == 2.0
    assert rank0["nan_loss_norm"] is None and rank1["nan_loss_norm"] is None  # rank 0 had no loss


def test_selective_and_full_recompute_equal_no_recompute():
    proc = run_python([os.path.join(REPO, "tests", "recompute_worker.py")], REPO, _env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # the same operations in the same order
    for name in ("selective", "selective-layernorm", "selective-mlp", "selective-mlp_act", "selective-all",
                 "selective-all-act", "full-uniform-1", "full-block-1"):
        assert result[name]["loss_equal"] and result[name]["grads_max_rel_diff"] == 0.0, name
    # groups of two layers sum the conditioning's gradient in another order: rounding only
    assert result["full-uniform-2"]["loss_equal"] and result["full-uniform-2"]["grads_max_rel_diff"] < 1e-6
    calls = {name: r["calls"] for name, r in result.items()}
    parts = ("layer", "core_attention", "mlp", "input_norm", "pre_mlp_norm")
    assert calls["none"] == {f"{k}{i}": 1 for k in parts for i in range(4)}
    twice = {k: {f"{k}{i}": 2 for i in range(4)} for k in parts[1:]}
    assert calls["selective"] == {**calls["none"], **twice["core_attention"]}
    assert calls["selective-layernorm"] == {**calls["none"], **twice["input_norm"], **twice["pre_mlp_norm"]}
    assert calls["selective-mlp"] == {**calls["none"], **twice["mlp"]}
    assert calls["selective-all"] == {**calls["none"], **{k: v for t in twice.values() for k, v in t.items()}}
    # the activation alone, twice (forward and backward); the MLP's linears once
    activation_twice = {f"activation{i}": 2 for i in range(4)}
    assert calls["selective-mlp_act"] == {**calls["none"], **activation_twice}
    assert calls["selective-all-act"] == {**calls["none"], **twice["core_attention"], **twice["input_norm"],
                                          **twice["pre_mlp_norm"], **activation_twice}
    assert calls["full-uniform-2"] == {k: 2 for k in calls["none"]}
    assert calls["full-block-1"] == {**calls["none"], **{f"{k}0": 2 for k in parts}}


def test_the_metrics_file_writes_a_non_finite_value_as_null(world_of_one, tmp_path):
    """JSON lines have no NaN or Infinity (strict readers refuse them): a diverged loss or NELBO is null."""
    from megatron_dllm.training.logger import Logger

    logger = Logger(None, str(tmp_path / "metrics.jsonl"))
    logger.train(1, 2, float("nan"), 1e-3, None, 10.0, 0.0, 8, 100)
    logger.valid(1, float("inf"), 100)
    logger.close()
    records = [json.loads(line, parse_constant=pytest.fail) for line in open(tmp_path / "metrics.jsonl")]
    assert (records[0]["loss"], records[0]["grad_norm"], records[1]["valid_nelbo"], records[1]["valid_ppl"]) == (
        None, None, None, None)
    assert records[0]["lr"] == 1e-3 and records[1]["flops"] == 100
