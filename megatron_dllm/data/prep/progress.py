"""The progress of a long data preparation: a redrawn status line on a TTY, else periodic log lines."""

from __future__ import annotations

import math
import sys
import time
from typing import Callable, Optional


def _hms(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "--:--:--"
    s = int(seconds)
    return f"{s // 3600:d}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    """A redrawn status line on a TTY (docs/s, tokens/s, MB/s, % and ETA by input bytes read),
    otherwise a log line every `log_interval` seconds."""

    def __init__(self, total_bytes: int, log: Callable[[str], None], tty: Optional[bool] = None,
                 log_interval: float = 30.0, label: str = "") -> None:
        self.total, self.log, self.label = total_bytes, log, label
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.interval = 0.25 if self.tty else log_interval
        self.t0 = self.last = time.time()
        self.docs = self.tokens = self.bytes = 0

    def line(self) -> str:
        dt = max(time.time() - self.t0, 1e-9)
        frac = self.bytes / self.total if self.total else float("nan")
        eta = dt * (1 - frac) / frac if self.total and frac > 0 else float("nan")
        pct = f"{100 * frac:5.1f}%" if self.total else "  ?  "
        return (f"{self.label}{pct} {self.docs} docs {self.tokens} tokens | {self.docs / dt:.1f} docs/s "
                f"{self.tokens / dt:.0f} tokens/s {self.bytes / dt / 1e6:.2f} MB/s | "
                f"{self.bytes / 1e6:.1f}/{self.total / 1e6:.1f} MB | elapsed {_hms(dt)} ETA {_hms(eta)}")

    def update(self, docs: int, tokens: int, bytes_done: int) -> None:
        self.docs += docs
        self.tokens += tokens
        self.bytes = bytes_done
        now = time.time()
        if now - self.last >= self.interval:
            self.last = now
            if self.tty:
                sys.stderr.write("\r\x1b[K" + self.line())
                sys.stderr.flush()
            else:
                self.log(self.line())

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\r\x1b[K" + self.line() + "\n")
            sys.stderr.flush()
