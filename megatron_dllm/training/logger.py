"""Log lines on the last rank (which holds the losses, as in Megatron-LM), TensorBoard and
(optionally) Weights & Biases, with Megatron-LM's scalar names ('lm loss', 'learning-rate',
'grad-norm', ..., each also 'NAME vs samples')."""
from __future__ import annotations

import json
import math
import os
import stat
import uuid

import torch.distributed as dist

from megatron_dllm import platform
from megatron_dllm.errors import InputError

# In --save: the id that names this run's records in --metrics-file. It moves with the directory
# and goes with it, so a moved run still knows its records and a new run in a reused path does not
# take an old one's for its own.
RUN_ID_FILE = "metrics_run_id.txt"


class Logger:
    def __init__(self, tensorboard_dir: str | None, metrics_file: str | None = None, wandb_dir: str | None = None,
                 save_dir: str | None = None):
        """Opens the files on the last rank; a file it cannot write is every rank's one error
        (the other ranks would otherwise wait in a collective the last rank never reaches).
        With `save_dir` (--save), each metrics record names it and the run id kept there
        (`RUN_ID_FILE`): the attempts of one run share it, which tells a resume its own records from
        another run's in a shared file."""
        self.active = dist.get_rank() == dist.get_world_size() - 1
        self.save = os.path.realpath(save_dir) if save_dir else None
        self.run = None
        self.writer = self.metrics = None
        self.extra_writers = []
        error = None
        if self.active:
            try:
                if wandb_dir:
                    flag, path = "--wandb-save-dir", wandb_dir
                    os.makedirs(wandb_dir, exist_ok=True)
                if tensorboard_dir:
                    from torch.utils.tensorboard import SummaryWriter

                    flag, path = "--tensorboard-dir", tensorboard_dir
                    self.writer = SummaryWriter(log_dir=tensorboard_dir)
                if metrics_file:
                    flag, path = "--metrics-file", metrics_file
                    self.metrics = open(metrics_file, "a")
            except OSError as err:
                error = f"{flag} {path}: cannot write there ({err.strerror or err})"
        _raise_on_every_rank(error)

    def _run_id(self, create: bool) -> str | None:
        """The run id in --save (made by the run's first record; None before it)."""
        if self.run is not None:
            return self.run
        path = os.path.join(self.save, RUN_ID_FILE)
        try:
            if create and not os.path.exists(path):
                os.makedirs(self.save, exist_ok=True)
                with open(path, "x") as f:
                    f.write(uuid.uuid4().hex + "\n")
            if os.path.exists(path):
                with open(path) as f:
                    self.run = f.read().strip()
        except OSError as err:
            raise InputError(f"--save {self.save}: cannot keep the run id of --metrics-file there ({path}: "
                             f"{err.strerror or err})") from None
        return self.run

    def resumed_at(self, iteration: int, validating_only: bool = False) -> None:
        """A resumed run trains again the iterations after its checkpoint (all of them, when an
        earlier attempt was killed before its first save): the records an earlier attempt (the run
        id in --save) wrote of them, the metrics file's last lines, are cut off (and a last line the
        kill cut short), so that every iteration has one record. Records of earlier versions name
        the --save path or nothing; they are taken for its own only on a resume from a checkpoint
        (the path's, or any). `validating_only`: a run that only validates its checkpoint's
        iteration: only its earlier validation of it goes.
        Another run's records stay, and so does a stream's (a pipe or terminal cannot be cut).
        TensorBoard keeps both attempts' points, as Megatron-LM's does (its purge_step would also
        hide the earlier 'vs samples' points, whose steps are samples)."""
        error = None
        if (self.active and self.metrics is not None and self.save is not None
                and stat.S_ISREG(os.fstat(self.metrics.fileno()).st_mode)):
            try:
                dropped = _cut_replayed(self.metrics.name, iteration, self._run_id(create=False),
                                        self.save if iteration > 0 else None, validating_only,
                                        unnamed=iteration > 0 and not validating_only)
            except OSError as err:
                error = (f"--metrics-file {self.metrics.name}: cannot cut the records of iterations after "
                         f"{iteration} ({err.strerror or err})")
            else:
                what = (f"its validation of iteration {iteration}, which this run repeats" if validating_only
                        else f"iterations after {iteration}, which this run trains again")
                if dropped:
                    self.info(f"--metrics-file {self.metrics.name}: dropped its last {dropped} records ({what}, "
                              f"or a line cut short)")
        _raise_on_every_rank(error)

    def add_writer(self, writer) -> None:
        """Another scalar sink with TensorBoard's add_scalar(tag, value, step) (e.g. W&B)."""
        if self.active:
            self.extra_writers.append(writer)

    def _scalars(self, iteration: int, consumed: int | None, **values) -> None:
        """Megatron-LM's tags: each value by iteration, and (with `consumed`) 'TAG vs samples'."""
        for writer in ([self.writer] if self.writer else []) + self.extra_writers:
            for tag, value in values.items():
                if value is None:
                    continue
                writer.add_scalar(tag, value, iteration)
                if consumed is not None and writer is self.writer:
                    writer.add_scalar(f"{tag} vs samples", value, consumed)

    def _record(self, **values) -> None:
        if self.metrics:  # JSON has no NaN or infinity: a non-finite value is null
            values = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in values.items()}
            if self.save is not None:
                values.update(save=self.save, run=self._run_id(create=True))
            try:
                self.metrics.write(json.dumps(values, allow_nan=False) + "\n")
                self.metrics.flush()
            except OSError as err:  # a full disk: the write names no file
                raise InputError(f"--metrics-file {self.metrics.name}: cannot write ({err.strerror or err})") from None

    def info(self, message: str) -> None:
        if self.active:
            print(message, flush=True)

    def train(self, iteration, total, loss, lr, grad_norm, tokens_per_s, tflops, consumed, flops,
              extra_text: str = "", extra: dict | None = None, scalars: dict | None = None) -> None:
        """One log line; `extra_text` is appended to it, `extra` goes into the metrics file and
        `scalars` (Megatron-LM tag -> value) to TensorBoard/W&B besides the standard ones."""
        if not self.active:
            return
        grad = "skipped" if grad_norm is None else f"{grad_norm:.3f}"
        line = (f" iteration {iteration:7d}/{total} | consumed samples {consumed} | lr {lr:.3e} | "
                f"loss {loss:.4f} | grad norm {grad} | tokens/s {tokens_per_s:,.0f} | "
                f"TFLOP/s per device {tflops:.2f} | FLOPs {flops:.4g}{extra_text}")
        print(line, flush=True)
        self._record(iteration=iteration, loss=loss, lr=lr, grad_norm=grad_norm,
                     tokens_per_s=tokens_per_s, tflops_per_device=tflops, consumed_samples=consumed,
                     flops=flops, **(extra or {}))
        self._scalars(iteration, consumed, **{"lm loss": loss, "learning-rate": lr, "grad-norm": grad_norm,
                                              "tokens-per-second": tokens_per_s, "throughput": tflops})
        self._scalars(iteration, None, **(scalars or {}))

    def valid(self, iteration, nelbo, flops=None, consumed=None) -> None:
        if not self.active or nelbo is None:
            return
        ppl = math.exp(min(nelbo, 50.0)) if math.isfinite(nelbo) else nelbo  # a diverged NELBO has no PPL
        print(f" validation at iteration {iteration} | nelbo {nelbo:.4f} | ppl {ppl:.3f}", flush=True)
        self._record(iteration=iteration, valid_nelbo=nelbo, valid_ppl=ppl,
                     **({} if flops is None else {"flops": flops}),
                     **({} if consumed is None else {"consumed_samples": consumed}))
        self._scalars(iteration, consumed, **{"lm loss validation": nelbo, "lm loss validation ppl": ppl})

    def close(self) -> None:
        for writer in self.extra_writers:
            writer.close()
        self.extra_writers = []
        if self.writer:
            self.writer.close()
        if self.metrics:
            self.metrics.close()


def _raise_on_every_rank(error: str | None) -> None:
    """The last rank's file error (or None) raised on every rank: the others would otherwise wait
    in a collective the last rank never reaches."""
    error = platform.from_rank(error, dist.get_world_size() - 1)
    if error is not None:
        raise InputError(error)


def _cut_replayed(path: str, iteration: int, run: str | None, save: str | None, validating_only: bool = False,
                  unnamed: bool = False) -> int:
    """Truncate the metrics file `path` before its trailing records of run `run`'s iterations
    after `iteration` (`validating_only`: its validation at `iteration` only), and a last line
    without its newline; returns how many lines were cut. Records of earlier versions count as the
    run's when they name no run but the --save path `save`, or (`unnamed`) nothing at all."""
    with open(path, "rb") as f:
        lines = f.readlines()
    keep = len(lines)
    while keep and (not lines[keep - 1].endswith(b"\n")
                    or _replayed(lines[keep - 1], iteration, run, save, validating_only, unnamed)):
        keep -= 1
    if keep < len(lines):
        os.truncate(path, sum(map(len, lines[:keep])))
    return len(lines) - keep


def _replayed(line: bytes, iteration: int, run: str | None, save: str | None, validating_only: bool,
              unnamed: bool) -> bool:
    """Whether a metrics-file line is what `_cut_replayed` cuts."""
    try:
        record = json.loads(line)
    except ValueError:
        return False
    if not isinstance(record, dict):
        return False
    if "run" in record:
        own = run is not None and record["run"] == run
    elif "save" in record:
        own = save is not None and record["save"] == save
    else:
        own = unnamed
    if not own:
        return False
    recorded = record.get("iteration")
    if not isinstance(recorded, int):
        return False
    if validating_only:
        return recorded == iteration and "valid_nelbo" in record
    return recorded > iteration
