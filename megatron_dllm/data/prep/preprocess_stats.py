"""What a preprocessing run counts: records read, per key written / rejected (by reason) / tokens,
and the first rejections with their file and line; `summary` is the run's closing report."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

MAX_PRINTED_REJECTIONS = 20  # logged, and kept in a shard's .done.json
MAX_KEPT_REJECTIONS = 1000  # kept in memory; the full lists are the datasets' _rejected.tsv


@dataclass
class KeyStats:
    written: int = 0
    tokens: int = 0
    rejected: Counter = field(default_factory=Counter)  # reason -> count


@dataclass
class PreprocessStats:
    read: int = 0  # records (JSON lines / Parquet rows / text paragraphs)
    keys: Dict[str, KeyStats] = field(default_factory=dict)
    output_prefixes: Dict[str, str] = field(default_factory=dict)  # key -> dataset prefix
    rejections: List[Tuple[str, int, str, str]] = field(default_factory=list)  # file, line/row, key, reason
    rejections_files: Dict[str, str] = field(default_factory=dict)  # key -> its dataset's report, if any
    seconds: float = 0.0
    input_files: int = 0
    input_bytes: int = 0
    blank_lines: int = 0
    skipped: bool = False  # a finished shard found on disk, not redone
    shard: Optional[Tuple[int, int]] = None  # (index, count)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.keys.values())

    def summary(self) -> str:
        rate = lambda n: n / self.seconds if self.seconds > 0 else float("nan")  # noqa: E731
        where = f"shard {self.shard[0]} of {self.shard[1]}: " if self.shard else ""
        if self.skipped:
            where += "already finished, skipped (delete its .done.json or pass --overwrite to redo); "
        lines = [f"{where}documents read: {self.read} from {self.input_files} files "
                 f"({self.input_bytes / 1e6:.1f} MB) in {self.seconds:.1f} s; "
                 f"{rate(self.read):.1f} docs/s, {rate(self.tokens):.0f} tokens/s, "
                 f"{rate(self.input_bytes) / 1e6:.2f} MB/s"
                 + (f"; {self.blank_lines} blank lines skipped" if self.blank_lines else "")]
        for key, s in self.keys.items():
            rej = sum(s.rejected.values())
            by_reason = ", ".join(f"{r}={n}" for r, n in sorted(s.rejected.items())) or "none"
            lines.append(f"  [{key}] written: {s.written}, rejected: {rej} ({by_reason}), "
                         f"tokens written: {s.tokens} -> {self.output_prefixes[key]}.bin/.idx")
            if key in self.rejections_files:
                lines.append(f"  [{key}] all rejections with file and line/row: {self.rejections_files[key]}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        d = asdict(self)
        d["keys"] = {k: {"written": s.written, "tokens": s.tokens, "rejected": dict(s.rejected)}
                     for k, s in self.keys.items()}
        d["rejections"] = [list(r) for r in self.rejections[:MAX_PRINTED_REJECTIONS]]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "PreprocessStats":
        st = cls(**{k: v for k, v in d.items() if k not in ("keys", "rejections", "shard")})
        st.keys = {k: KeyStats(v["written"], v["tokens"], Counter(v["rejected"])) for k, v in d["keys"].items()}
        st.rejections = [tuple(r) for r in d.get("rejections", [])]
        st.shard = tuple(d["shard"]) if d.get("shard") else None
        return st
