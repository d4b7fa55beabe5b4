"""The chaos soak (`tools/chaos_resume.py`) at a small scale: a 2-rank run with async saves is
killed three times at seeded random moments (SIGKILL and SIGTERM, whole process tree), restarted
with the same command until it completes, and compared with an uninterrupted run: losses of every
attempt and every checkpoint bit for bit, no leftover process, no `.incomplete`, manifests verified.
Also what the soak found: a SIGTERM forwarded by torchrun to a rank's process group after an
asynchronous save must still end in a save and a clean exit."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, TINY_RUN, launch_env

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def test_a_run_killed_at_random_moments_resumes_bit_identically(tmp_path):
    work = tmp_path / "w"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "chaos_resume.py"), "--work", str(work),
                           "--kills", "3", "--seed", "3", "--train-iters", "6",
                           "--attempt-timeout", "240"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    kills = re.findall(r"^kill \d/3: (SIGKILL|SIGTERM) at .* during (startup|first iteration|training|save)",
                       proc.stdout, re.M)
    assert len(kills) == 3, proc.stdout
    assert re.search(r"^chaos-resume: PASS \(seed 3\): 3 of 3 kills .* checkpoints \[2, 4, 6\] equal bit for bit",
                     proc.stdout, re.M), proc.stdout
    assert not list((work / "chaos" / "ckpt").glob("*.incomplete"))

    # the comparison is not vacuous: two checkpoints of different iterations are told apart
    from megatron_dllm.cli.chaos_resume import Mismatch, compare_checkpoints

    ckpt = work / "reference" / "ckpt"
    compare_checkpoints(str(ckpt / "iter_0000006"), str(work / "chaos" / "ckpt" / "iter_0000006"), str(tmp_path))
    with pytest.raises(Mismatch, match="iter_0000004 sharded state.*tensors differ"):
        compare_checkpoints(str(ckpt / "iter_0000004"), str(ckpt / "iter_0000006"), str(tmp_path))


def test_sigterm_forwarded_by_torchrun_after_an_async_save_still_saves(demo_cache, tmp_path):
    """torchrun forwards a SIGTERM to each rank's process group, which holds megatron-core's
    async-save results server (spawned at the first save). The server used to die of it, and the
    rank with it (BrokenPipeError) instead of saving: the run lost the iterations since its last
    checkpoint and left an `.incomplete`."""
    ckpt, log_path = tmp_path / "ckpt", tmp_path / "run.log"
    flags = ["--demo-cache-dir", demo_cache, *TINY_RUN, "--eval-interval", "100", "--train-iters", "60",
             "--save-interval", "2", "--async-save", "--exit-signal-handler",
             "--save", str(ckpt), "--load", str(ckpt), "--tensorboard-dir", str(tmp_path / "tb")]
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                 os.path.join(REPO, "pretrain_dllm.py"), *flags], cwd=str(tmp_path),
                                env=launch_env(2), stdout=log, stderr=log, start_new_session=True)
    try:
        deadline = time.time() + 240
        while f"saved checkpoint {ckpt / 'iter_0000002'}" not in log_path.read_text():  # the server is up
            assert proc.poll() is None and time.time() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)  # torchrun alone, as a scheduler's preemption notice
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = log_path.read_text()
    stopped = re.search(r"^exiting after iteration (\d+): received SIGTERM$", out, re.M)
    assert stopped, out[-3000:]
    it = int(stopped.group(1))
    assert 2 <= it < 60 and f"saved checkpoint {ckpt / f'iter_{it:07d}'}" in out, out[-3000:]
    assert "[rank0]: Traceback" not in out and "[rank1]: Traceback" not in out, out[-3000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(it)
    assert not list(ckpt.glob("*.incomplete"))


def test_a_process_runs_until_its_last_thread_has_ended(tmp_path):
    """A process whose main thread has ended while another thread goes on (as a killed rank's
    writer thread finishing an fsync) still holds its files, its output's lock among them: it is
    running, and found by its mark, until its last thread is gone. Its main thread alone reads as
    a zombie, which the check once took for the whole process."""
    from megatron_dllm.cli.chaos_resume import MARK, marked_processes, running

    code = ("import ctypes, threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); "
            "ctypes.CDLL(None).pthread_exit(None)")
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, MARK: str(tmp_path)})
    try:
        deadline = time.time() + 30
        while time.time() < deadline:
            with open(f"/proc/{proc.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.01)
        else:
            pytest.fail("the main thread never ended")
        assert running(proc.pid)
        assert [pid for pid, _ in marked_processes(str(tmp_path))] == [proc.pid]
    finally:
        proc.kill()
        proc.wait()
    assert not running(proc.pid) and marked_processes(str(tmp_path)) == []
