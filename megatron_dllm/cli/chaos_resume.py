"""A chaos soak of resuming: kill a 2-rank training run at random moments, restart it with the same
command until it completes, and check that nothing differs from an uninterrupted run.

    python tools/chaos_resume.py --work /tmp/chaos --kills 10 --seed 1

It prepares the demo corpus in WORK, runs the reference (uninterrupted) in WORK/reference, then
runs the same command in WORK/chaos (`torchrun --nproc-per-node 2 pretrain_dllm.py ... --async-save
--exit-signal-handler --save CKPT --load CKPT`) and kills its whole process tree (torchrun, the
ranks, their checkpoint writers) --kills times, SIGKILL or SIGTERM at random. Each kill aims at a
phase in turn and is reported with the phase seen at the moment of the kill: startup (imports,
rendezvous, the removal of unfinished saves, the checkpoint load: before the training loop's first
log line), the first iteration after a start, training, and a save (a staging directory of this
attempt's exists, its writer at work or its rename not yet done). Then it checks:

- every loss record of every attempt (repeated iterations included) equals the reference's, and so
  does the final validation;
- every checkpoint both runs saved holds the same tensors and common state, bit for bit;
- after each attempt, no process of the run is left (found by an environment marker every
  process of the run inherits, so reparented or re-sessioned ones too);
- no `*.incomplete` staging directory is left, and every checkpoint passes
  `verify_checkpoint.py --all`.

It prints one line per kill and a final verdict; exit 0 when all holds, 1 naming the first
difference otherwise, 2 for bad input.
"""
from __future__ import annotations

import glob
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from megatron_dllm import platform  # noqa: F401  (first: on CPU it quiets megatron-core's fallback warnings)
from megatron_dllm.cli import OneLineParser, fail, reports_bad_input

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRETRAIN = os.path.join(REPO, "pretrain_dllm.py")
MARK = "DLLM_CHAOS_RUN"  # inherited by every process a run starts: how leftovers are found
PHASES = ("startup", "first iteration", "training", "save")
TRACKER = "latest_checkpointed_iteration.txt"
SIGTERM_GRACE_S = 90  # torchrun SIGKILLs its workers 30 s after forwarding a SIGTERM


class Mismatch(Exception):
    """The first difference found; its message is the verdict."""


@dataclass
class Attempt:
    number: int
    log: str
    metrics_start: list  # the metrics file's lines when it started (what the attempts before left)
    left_staged: frozenset = frozenset()  # inodes of the staging directories there at its start
    metrics_end: list = field(default_factory=list)  # its lines when it ended
    returncode: int | None = None
    kill: dict | None = None  # signal, phase, time, and what the run did
    leftovers: list = field(default_factory=list)


def training_flags(work: str, run: str, train_iters: int, save_interval: int, signal_handler: bool) -> list[str]:
    """pretrain_dllm.py's flags for `run` (reference or chaos): tiny model, demo corpus, async saves
    into --save == --load, an EMA (so its restore is compared too), validation at the end."""
    ckpt = os.path.join(work, run, "ckpt")
    return ["--demo-cache-dir", os.path.join(work, "demo"), "--preset", "cpu-tiny", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--lr-warmup-iters", "0",
            "--log-interval", "1", "--eval-interval", str(train_iters), "--eval-iters", "1",
            "--train-iters", str(train_iters), "--save-interval", str(save_interval), "--ema-decay", "0.9",
            "--async-save", *(["--exit-signal-handler"] if signal_handler else []),
            "--save", ckpt, "--load", ckpt, "--tensorboard-dir", os.path.join(work, run, "tb"),
            "--metrics-file", os.path.join(work, run, "metrics.jsonl")]


def launch(flags: list[str], cwd: str, log: str, nproc: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           PRETRAIN, *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": "",
           MARK: os.path.abspath(cwd)}
    with open(log, "w") as out:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


# ---------------------------------------------------------------- processes


def children(pid: int) -> list[int]:
    kids = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(k) for k in f.read().split()]
    except OSError:  # the process or a thread ended meanwhile
        pass
    return kids


def _live_thread(pid: int) -> str | None:
    """/proc/PID/task/TID of a thread of `pid` that has not ended, or None once none is left. A
    killed process's main thread can end (and read as a zombie, with empty command line and
    environment) while another thread still finishes a write, a save's fsync: the process holds
    its files, its output's lock among them, until its last thread is gone."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for thread in threads:
        path = f"/proc/{pid}/task/{thread}"
        try:
            with open(f"{path}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    return path
        except OSError:
            continue
    return None


def running(pid: int) -> bool:
    """Whether `pid` exists and has a thread that has not ended (not a zombie)."""
    return _live_thread(pid) is not None


def process_tree(pid: int) -> list[int]:
    tree, todo = [pid], [pid]
    while todo:
        kids = children(todo.pop())
        tree += kids
        todo += kids
    return tree


def signal_tree(pid: int, sig: int) -> None:
    """Signal every process group of the tree under `pid` at once (torchrun starts each rank in a
    session of its own; a rank's forked writer shares the rank's group), as a scheduler would."""
    groups = set()
    for p in process_tree(pid):
        try:
            groups.add(os.getpgid(p))
        except ProcessLookupError:
            pass
    for group in groups:
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            pass


def marked_processes(mark: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose environment carries MARK=mark, or whose
    command line names the directory `mark` (a spawned process may not carry the environment)."""
    needle = f"{MARK}={mark}".encode() + b"\0"
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        thread = _live_thread(int(name))
        if thread is None:  # a zombie runs nothing
            continue
        try:
            with open(f"{thread}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"{thread}/environ", "rb") as f:
                if needle not in f.read() + b"\0" and mark + os.sep not in cmdline:
                    continue
        except OSError:  # gone meanwhile, or not ours to read
            continue
        found.append((int(name), cmdline))
    return found


def describe_stuck(mark: str, ckpt: str) -> str:
    """What a run that did not finish in time was doing: its processes (state, kernel wait
    channel) and the files of its staged saves, for the failure message."""
    parts = []
    for pid, cmdline in marked_processes(mark):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{pid}/wchan") as f:
                wchan = f.read()
        except OSError:
            continue
        parts.append(f"pid {pid} {state} {wchan or '-'}: {cmdline[:90]}")
    for path in staged_saves(ckpt):
        parts.append(f"{os.path.basename(path)} holds {sorted(os.listdir(path))}")
    return "; ".join(parts)


def leftovers(mark: str, wait_s: float = 3.0) -> list[tuple[int, str]]:
    """Processes of the run still alive `wait_s` after it ended (the parent watches need 0.5 s);
    they are SIGKILLed once reported so that the soak can go on."""
    deadline = time.time() + wait_s
    while (found := marked_processes(mark)) and time.time() < deadline:
        time.sleep(0.1)
    for pid, _ in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return found


# ---------------------------------------------------------------- what the run has done


def staged_saves(ckpt: str, old: frozenset = frozenset()) -> dict[str, int]:
    """{path: inode} of the staging directories, but those in `old` (the inodes a killed attempt
    left behind, which the next start removes: not a save of that attempt). `*.incomplete`, not
    `iter_N.incomplete`: the name may carry a run id."""
    found = {}
    for path in glob.glob(os.path.join(ckpt, "iter_*.incomplete")):
        try:
            inode = os.stat(path).st_ino
        except FileNotFoundError:  # renamed into place or removed meanwhile
            continue
        if inode not in old:
            found[path] = inode
    return dict(sorted(found.items()))


def metrics_lines(path: str) -> list[bytes]:
    """The metrics file's lines as they stand (the last one without its newline if a kill cut it)."""
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        return f.readlines()


def read_records(lines: list[bytes], kept: int = 0) -> tuple[list[dict], int]:
    """The JSON records of `lines` after the first `kept`, and how many lines were cut short (a
    kill in the middle of a write leaves a line without its newline)."""
    records, cut = [], 0
    for line in lines[kept:]:
        try:
            if not line.endswith(b"\n"):
                raise ValueError
            records.append(json.loads(line))
        except ValueError:
            cut += 1
    return records, cut


def kept_lines(attempt) -> int:
    """How many lines of the metrics file as the attempt found it are not its own: all but those
    it cut at its start (the records of the iterations it trains again, which its log counts)."""
    try:
        with open(attempt.log, errors="replace") as f:
            dropped = re.search(r"--metrics-file .*: dropped its last (\d+) records", f.read())
    except FileNotFoundError:  # not started yet
        dropped = None
    return len(attempt.metrics_start) - (int(dropped[1]) if dropped else 0)


def read_tracker(ckpt: str) -> int | None:
    try:
        with open(os.path.join(ckpt, TRACKER)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------- the soak


class Soak:
    def __init__(self, args):
        self.args, self.rng = args, random.Random(args.seed)
        self.work = os.path.abspath(args.work)
        self.chaos_dir = os.path.join(self.work, "chaos")
        self.ckpt = os.path.join(self.chaos_dir, "ckpt")
        self.metrics = os.path.join(self.chaos_dir, "metrics.jsonl")
        self.flags = training_flags(self.work, "chaos", args.train_iters, args.save_interval, args.signal_handler)
        self.attempts: list[Attempt] = []

    def say(self, text: str) -> None:
        print(text, flush=True)

    def reference(self) -> float:
        run = os.path.join(self.work, "reference")
        os.makedirs(run)
        start = time.time()
        proc = launch(training_flags(self.work, "reference", self.args.train_iters, self.args.save_interval,
                                     self.args.signal_handler), run, os.path.join(run, "run.log"), self.args.nproc)
        try:
            code = proc.wait(timeout=self.args.attempt_timeout)
        except subprocess.TimeoutExpired:
            raise Mismatch(f"the reference run did not finish in {self.args.attempt_timeout} s (see {run}/run.log): "
                           + describe_stuck(run, os.path.join(run, "ckpt"))) from None
        finally:  # also on Ctrl-C
            if proc.poll() is None:
                signal_tree(proc.pid, signal.SIGKILL)
                proc.wait()
        if code != 0:
            raise Mismatch(f"the reference run failed (exit {code}); see {run}/run.log")
        if (left := leftovers(run)):
            raise Mismatch(f"the reference run left processes behind: {left}")
        return time.time() - start

    def plan(self) -> list[tuple[int, str]]:
        """(signal, phase) per kill: the phases in turn, shuffled in rounds so each one comes up."""
        phases = []
        while len(phases) < self.args.kills:
            phases += self.rng.sample(PHASES, len(PHASES))
        sigs = [signal.SIGTERM if self.rng.random() < self.args.sigterm_fraction else signal.SIGKILL
                for _ in range(self.args.kills)]
        return list(zip(sigs, phases[:self.args.kills]))

    def _observe(self, attempt: Attempt) -> dict:
        records, _ = read_records(metrics_lines(self.metrics), kept_lines(attempt))
        iters = [r["iteration"] for r in records if "loss" in r]
        with open(attempt.log, errors="replace") as f:
            log = f.read()
        return {"iterations": iters, "started": "\nfamily " in log or log.startswith("family "),
                "staged": list(staged_saves(self.ckpt, attempt.left_staged))}

    def _trigger(self, phase: str, attempt: Attempt, start: float, state: dict):
        """True when the kill aimed at `phase` is due. `state` keeps the attempt's random draws."""
        seen = self._observe(attempt)
        if phase == "startup":
            return time.time() - start >= state.setdefault("at", self.rng.uniform(0.0, self.args.startup_s))
        if phase == "first iteration":  # the training loop began (checkpoint loaded), nothing logged yet
            if seen["started"] and "at" not in state:
                state["at"] = time.time() + self.rng.uniform(0.0, 0.1)  # the iteration takes about 0.3 s
            return "at" in state and time.time() >= state["at"]
        if phase == "training":  # a few iterations into this attempt, no save under way
            target = state.setdefault("target", self.rng.randint(1, self.args.save_interval + 1))
            if len(seen["iterations"]) >= target and not seen["staged"] and "at" not in state:
                state["at"] = time.time() + self.rng.uniform(0.0, 0.05)
            return "at" in state and time.time() >= state["at"]
        if seen["staged"] and "at" not in state:  # "save": a staged save exists
            state["at"] = time.time() + self.rng.uniform(0.0, 0.15)
        return "at" in state and time.time() >= state["at"]

    def _phase_now(self, attempt: Attempt) -> tuple[str, dict]:
        seen = self._observe(attempt)
        if seen["staged"]:
            phase = "save"
        elif not seen["started"]:
            phase = "startup"
        elif not seen["iterations"]:
            phase = "first iteration"
        else:
            phase = "training"
        return phase, seen

    def run_attempt(self, number: int, kill: tuple[int, str] | None) -> Attempt:
        attempt = Attempt(number, os.path.join(self.chaos_dir, f"attempt-{number:02d}.log"),
                          metrics_lines(self.metrics))
        attempt.left_staged = frozenset(staged_saves(self.ckpt).values())
        start = time.time()
        proc = launch(self.flags, self.chaos_dir, attempt.log, self.args.nproc)
        state: dict = {}
        try:
            while proc.poll() is None:
                if time.time() - start > self.args.attempt_timeout:
                    raise Mismatch(f"attempt {number} did not finish in {self.args.attempt_timeout} s "
                                   f"(see {attempt.log}): " + describe_stuck(self.chaos_dir, self.ckpt))
                if kill and self._trigger(kill[1], attempt, start, state):
                    attempt.kill = self._kill(proc, kill, attempt, start)
                    break
                time.sleep(0.005)
            attempt.returncode = proc.wait()
        finally:
            if proc.poll() is None:
                signal_tree(proc.pid, signal.SIGKILL)
                proc.wait()
        attempt.leftovers = leftovers(self.chaos_dir)
        attempt.metrics_end = metrics_lines(self.metrics)
        return attempt

    def _kill(self, proc, kill, attempt: Attempt, start: float) -> dict:
        sig, aimed = kill
        phase, seen = self._phase_now(attempt)
        done = seen["iterations"][-1] if seen["iterations"] else None
        at = time.time() - start
        signal_tree(proc.pid, sig)
        info = {"signal": signal.Signals(sig).name, "aimed": aimed, "phase": phase, "at": at,
                "clock": time.strftime("%H:%M:%S", time.gmtime()),
                "last_iteration": done, "staged": [os.path.basename(p) for p in seen["staged"]]}
        if sig == signal.SIGTERM:
            try:
                proc.wait(timeout=SIGTERM_GRACE_S)
            except subprocess.TimeoutExpired:
                info["hung"] = True
                signal_tree(proc.pid, signal.SIGKILL)
        return info

    def describe(self, attempt: Attempt, index: int) -> str:
        k = attempt.kill
        where = k["phase"] + (f" ({', '.join(k['staged'])} present)" if k["staged"] else "")
        last = "none" if k["last_iteration"] is None else k["last_iteration"]
        text = (f"kill {index}/{self.args.kills}: {k['signal']} at {k['clock']} UTC, {k['at']:.2f} s into attempt "
                f"{attempt.number} "
                f"during {where}, aimed at {k['aimed']}; last iteration logged by this attempt: {last}")
        if k["signal"] == "SIGTERM":
            with open(attempt.log, errors="replace") as f:
                log = f.read()
            if k.get("hung"):
                text += f"; not ended {SIGTERM_GRACE_S} s after SIGTERM, SIGKILLed"
            elif "received SIGTERM" in log:
                line = next(ln for ln in log.splitlines() if "received SIGTERM" in ln)
                text += f"; the ranks: '{line.strip()}' and saved; torchrun (SIGTERMed too) exit {attempt.returncode}"
            else:
                text += f"; died (no handler yet), torchrun exit {attempt.returncode}"
        return text

    def soak(self) -> None:
        os.makedirs(self.chaos_dir)
        plan = self.plan()
        kills = 0
        while True:
            number = len(self.attempts) + 1
            if number > self.args.kills + self.args.max_extra_attempts + 1:
                raise Mismatch(f"the run did not complete in {number - 1} attempts")
            attempt = self.run_attempt(number, plan[kills] if kills < len(plan) else None)
            self.attempts.append(attempt)
            if attempt.kill:
                kills += 1
                self.say(self.describe(attempt, kills))
                if attempt.kill["signal"] == "SIGTERM" and not attempt.kill.get("hung"):
                    self._check_sigterm(attempt)
            if attempt.leftovers:
                raise Mismatch(f"attempt {number} left {len(attempt.leftovers)} process(es) running after it "
                               f"ended: " + "; ".join(f"pid {p}: {c[:200]}" for p, c in attempt.leftovers))
            if attempt.kill is None:
                if attempt.returncode != 0:
                    raise Mismatch(f"attempt {number} (not killed) exited {attempt.returncode}; see {attempt.log}")
                self.say(f"attempt {number} ran to the end (exit 0)")
                return

    def _check_sigterm(self, attempt: Attempt) -> None:
        """With the handler, a SIGTERM once training began must end in a completed save at the
        iteration the ranks name, and no rank may fail."""
        with open(attempt.log, errors="replace") as f:
            log = f.read()
        for line in log.splitlines():
            if "exiting after iteration" in line and "received SIGTERM" in line:
                it = int(line.split("exiting after iteration", 1)[1].split(":")[0])
                if f"saved checkpoint {os.path.join(self.ckpt, f'iter_{it:07d}')}" not in log:
                    raise Mismatch(f"attempt {attempt.number}: SIGTERM stopped the run after iteration {it}, "
                                   f"but no save of iteration {it} completed (see {attempt.log})")
        # torchrun, SIGTERMed too, exits 1 with its own traceback; a rank's would name our code
        for trace in log.split("Traceback (most recent call last)")[1:]:
            if "megatron_dllm" in trace or "pretrain_dllm" in trace:
                raise Mismatch(f"attempt {attempt.number}: a rank failed after SIGTERM (see {attempt.log})")

    # ------------------------------------------------------------ comparisons

    def compare(self) -> dict:
        ref_dir = os.path.join(self.work, "reference")
        ref_ckpt = os.path.join(ref_dir, "ckpt")
        reference, _ = read_records(metrics_lines(os.path.join(ref_dir, "metrics.jsonl")))
        by_iter = {(r["iteration"], "loss" in r): r for r in reference}
        last = self.args.train_iters
        stats = {"records": 0, "repeated": 0, "cut": 0}
        trained: dict[int, int] = {}
        for attempt in self.attempts:
            records, cut = read_records(attempt.metrics_end, kept_lines(attempt))  # as the attempt left them
            stats["cut"] += cut
            for r in records:
                ref = by_iter.get((r["iteration"], "loss" in r))
                if ref is None:
                    raise Mismatch(f"attempt {attempt.number} logged iteration {r['iteration']}, which the "
                                   f"reference did not: {r}")
                keys = ("loss", "lr", "grad_norm", "consumed_samples", "flops") if "loss" in r else ("valid_nelbo",)
                for key in keys:
                    if r.get(key) != ref.get(key):
                        raise Mismatch(f"attempt {attempt.number}, iteration {r['iteration']}: {key} "
                                       f"{r.get(key)!r} != reference {ref.get(key)!r}")
                if "loss" in r:
                    stats["records"] += 1
                    trained[r["iteration"]] = trained.get(r["iteration"], 0) + 1
        missing = [i for i in range(1, last + 1) if i not in trained]
        if missing:
            raise Mismatch(f"iterations {missing} have no loss record in any attempt")
        stats["repeated"] = sum(n - 1 for n in trained.values())
        final, _ = read_records(metrics_lines(self.metrics))
        last_attempt = self.attempts[-1]
        if not any("valid_nelbo" in r for r in read_records(last_attempt.metrics_end, kept_lines(last_attempt))[0]):
            raise Mismatch("the completing attempt logged no final validation")
        logged = sorted(r["iteration"] for r in final if "loss" in r)
        if logged != sorted(r["iteration"] for r in reference if "loss" in r):  # the resumes' cuts
            raise Mismatch(f"the metrics file holds loss records of iterations {logged}, not each logged "
                           f"iteration once as the reference's")

        for d in (ref_ckpt, self.ckpt):
            if read_tracker(d) != last:
                raise Mismatch(f"{d}/{TRACKER} names {read_tracker(d)}, not {last}")
            if (left := sorted(glob.glob(os.path.join(d, "*.incomplete")) + glob.glob(os.path.join(d, "*.removing"))
                               + glob.glob(os.path.join(d, "*.replaced")))):
                raise Mismatch(f"left in {d}: {', '.join(os.path.basename(p) for p in left)}")
            code, out = verify_all(d)
            if code != 0:
                raise Mismatch(f"verify_checkpoint.py --all {d} failed: {out.strip()}")
            stats.setdefault("verified", []).append(sum(line.startswith("ok ") for line in out.splitlines()))

        from megatron_dllm.checkpoint import layout

        ours, theirs = layout.iterations(self.ckpt), layout.iterations(ref_ckpt)
        common = sorted(set(ours) & set(theirs))
        if last not in common:
            raise Mismatch(f"iteration {last} is not saved in both runs")
        for it in common:
            compare_checkpoints(ours[it], theirs[it], os.path.join(self.work, "converted"))
        stats["compared"], stats["extra"] = common, sorted(set(ours) - set(theirs))
        return stats


def verify_all(ckpt: str) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "verify_checkpoint.py"), ckpt, "--all"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return proc.returncode, proc.stdout + proc.stderr


def _same(a, b, where: str) -> None:
    import torch

    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            raise Mismatch(f"{where}: keys differ: only here {sorted(set(a) - set(b))[:5]}, "
                           f"only in the reference {sorted(set(b) - set(a))[:5]}")
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b):
        if len(a) != len(b):
            raise Mismatch(f"{where}: lengths {len(a)} != {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            raise Mismatch(f"{where}: tensors differ")
    elif hasattr(a, "__array__") and hasattr(b, "__array__"):
        import numpy as np

        if not np.array_equal(a, b):
            raise Mismatch(f"{where}: arrays differ")
    elif a != b:
        raise Mismatch(f"{where}: {str(a)[:80]} != reference {str(b)[:80]}")


def compare_checkpoints(ours: str, theirs: str, scratch: str) -> None:
    """Every tensor and object of the two torch_dist checkpoints (the sharded state, read back
    whole by torch's DCP reader, and megatron's common state) must be equal, bit for bit."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from megatron_dllm.checkpoint import writers
    from megatron_dllm.checkpoint.meta import read_common_state

    os.makedirs(scratch, exist_ok=True)
    states = []
    for side, path in (("chaos", ours), ("reference", theirs)):
        out = os.path.join(scratch, f"{side}-{os.path.basename(path)}.pt")
        dcp_to_torch_save(path, out)
        state = torch.load(out, weights_only=False)
        os.remove(out)
        # each run's writer records (its run id) differ by design; verify_checkpoint checks them
        states.append({k: v for k, v in state.items() if not k.startswith(writers.RECORD_KEY + "/")})
    _same(states[0], states[1], f"{os.path.basename(ours)} sharded state")
    _same(read_common_state(ours), read_common_state(theirs),
          f"{os.path.basename(ours)} common state")


@reports_bad_input()
def main(argv=None) -> int:
    p = OneLineParser(description=__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("--work", required=True, help="a new or empty directory for the corpus, both runs and their logs")
    p.add_argument("--kills", type=int, default=10, help="how many times the run is killed (default 10)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the signals, the phases aimed at and the delays; where a kill lands also depends "
                        "on the machine's speed")
    p.add_argument("--train-iters", type=int, default=None,
                   help="iterations of the run (default: enough that the kills come before the end, 2 x kills + 8)")
    p.add_argument("--save-interval", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2, help="ranks (data parallel)")
    p.add_argument("--sigterm-fraction", type=float, default=0.5, help="share of kills that are SIGTERM")
    p.add_argument("--no-exit-signal-handler", dest="signal_handler", action="store_false",
                   help="train without --exit-signal-handler: a SIGTERM then kills the run like SIGKILL")
    p.add_argument("--startup-s", type=float, default=8.0,
                   help="kills aimed at startup come within this many seconds of the launch")
    p.add_argument("--attempt-timeout", type=float, default=300.0)
    p.add_argument("--max-extra-attempts", type=int, default=3,
                   help="unkilled attempts allowed beyond kills + 1 before giving up")
    args = p.parse_args(argv)
    if args.kills < 0 or args.save_interval < 1 or args.nproc < 1 or not 0 <= args.sigterm_fraction <= 1:
        return fail("--kills must be >= 0, --save-interval and --nproc >= 1, --sigterm-fraction in [0, 1]")
    if args.train_iters is None:
        args.train_iters = 2 * args.kills + 8
    if args.train_iters < 1:
        return fail("--train-iters must be positive")
    try:
        os.makedirs(args.work, exist_ok=True)
    except OSError as err:
        return fail(f"--work {args.work}: cannot be made a directory ({err.strerror})")
    if os.listdir(args.work):
        return fail(f"--work {args.work}: not empty (give a new directory)")

    from megatron_dllm.data.prep.demo import prepare_demo_corpus

    soak, start = Soak(args), time.time()
    os.makedirs(soak.work, exist_ok=True)
    prepare_demo_corpus(os.path.join(soak.work, "demo"))
    try:
        ref_s = soak.reference()
        print(f"reference: {args.train_iters} iterations, uninterrupted, in {ref_s:.1f} s", flush=True)
        soak.soak()
        stats = soak.compare()
    except Mismatch as err:
        print(f"chaos-resume: FAIL (seed {args.seed}, {len(soak.attempts)} attempts, "
              f"{time.time() - start:.0f} s): {err}", flush=True)
        return 1
    kills = [a.kill for a in soak.attempts if a.kill]

    def count(key, names):
        return ", ".join(f"{sum(k[key] == n for k in kills)} {n}" for n in names)

    print(f"chaos-resume: PASS (seed {args.seed}): {len(kills)} of {args.kills} kills "
          f"({count('signal', ('SIGKILL', 'SIGTERM'))}; during {count('phase', PHASES)}), "
          f"{len(soak.attempts)} attempts; "
          f"{stats['records']} loss records ({stats['repeated']} of repeated iterations) equal the reference's; "
          f"checkpoints {stats['compared']} equal bit for bit (final weights, optimizer, EMA, RNG, common state); "
          f"{stats['verified'][1]} checkpoints verified; no .incomplete, no leftover process; "
          f"{time.time() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
