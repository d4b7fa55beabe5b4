"""Reading generated samples: tools/sample.py's JSON, or plain .jsonl / .txt files of texts.

- `.json`: an object with `texts` (list of str) and optionally `tokens` (the model's ids, one
  list per sample), as tools/sample.py writes it; its scalar fields, top-level or under
  `settings` (`family`, `steps`, `predictor`, ...), are kept as metadata.
- `.jsonl`: one sample per line, a JSON string or an object with a `text` key (and optionally
  `tokens`).
- anything else: plain text, one sample per non-empty line.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from megatron_dllm.errors import InputError


@dataclass
class Samples:
    texts: list[str]
    tokens: list[list[int]] | None          # the generating model's ids, when the file has them
    meta: dict = field(default_factory=dict)  # scalar fields of a sample.py file (family, steps, ...)


def _bad(path: str, why: str) -> InputError:
    return InputError(f"--samples {path}: {why}")


def _tokens_or_none(rows: list, path: str) -> list[list[int]] | None:
    if all(r is None for r in rows):
        return None
    if any(r is None for r in rows):
        raise _bad(path, "some samples have `tokens` and some do not")
    if not all(isinstance(r, list) and r and all(type(i) is int for i in r) for r in rows):
        raise _bad(path, "`tokens` must hold one non-empty list of integer ids per sample")
    return rows


def read_samples(path: str) -> Samples:
    if not os.path.isfile(path):
        raise _bad(path, "no such file")
    try:
        with open(path, encoding="utf-8-sig") as f:
            content = f.read()
    except UnicodeDecodeError as err:
        raise _bad(path, f"not UTF-8 text (byte {err.start}); expected tools/sample.py's JSON, JSONL or a text "
                         f"file of samples") from None
    if path.endswith(".json"):
        try:
            data = json.loads(content)
        except json.JSONDecodeError as err:
            raise _bad(path, f"not valid JSON ({err})") from None
        if not isinstance(data, dict) or "texts" not in data:
            raise _bad(path, "expected a JSON object with a `texts` list (tools/sample.py output)")
        if data["texts"] is None:
            raise _bad(path, "holds no `texts` (tools/sample.py had no tokenizer): sample again with "
                             "--tokenizer-type/--tokenizer-model")
        texts = data["texts"]
        if not isinstance(texts, list):
            raise _bad(path, "`texts` must be a list of strings")
        tokens = data.get("tokens")
        if tokens is not None and not isinstance(tokens, list):
            raise _bad(path, "`tokens` must hold one non-empty list of integer ids per sample")
        if tokens is not None and len(tokens) != len(texts):
            raise _bad(path, f"{len(texts)} texts but {len(tokens)} token lists")
        tokens = None if tokens is None else _tokens_or_none(tokens, path)
        # tools/sample.py keeps its settings (family, steps, predictor, ...) under "settings"
        fields = {**data, **(data.get("settings") if isinstance(data.get("settings"), dict) else {})}
        meta = {k: v for k, v in fields.items() if k not in ("texts", "tokens") and not isinstance(v, (list, dict))}
    elif path.endswith(".jsonl"):
        texts, rows = [], []
        for n, line in enumerate(content.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise _bad(path, f"line {n} is not valid JSON ({err})") from None
            if isinstance(row, dict) and isinstance(row.get("text"), str):
                texts.append(row["text"])
                rows.append(row.get("tokens"))
            elif isinstance(row, str):
                texts.append(row)
                rows.append(None)
            else:
                raise _bad(path, f"line {n}: expected a JSON string or an object with a `text` key")
        tokens, meta = _tokens_or_none(rows, path), {}
    else:
        texts, tokens, meta = [line for line in content.splitlines() if line.strip()], None, {}
    if not texts or not all(isinstance(t, str) for t in texts):
        raise _bad(path, "no samples found (expected non-empty texts)")
    return Samples(texts, tokens, meta)
