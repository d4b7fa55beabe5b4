"""Supervised fine-tuning data: prompt/response examples -> fixed-length Megatron rows + prompt mask.

Inputs (one example per record):
  - JSONL with `prompt` / `response` fields (other names: `prompt_key`, `response_key`);
  - JSONL with a chat-style `messages` list ([{role, content}, ...]): the last assistant message is
    the response, everything before it the prompt, rendered "Role: content" per line and ending
    with "Assistant: ";
  - Deng et al.'s augmented GSM8K text (`.txt`, `question||reasoning #### answer` per line),
    rendered as the masked-diffusion SFT recipes do (SMDM, sft/gsm8k_data.py): prompt
    "Question: q\\n", response "Answer: reasoning\\n#### answer". (SMDM additionally splits each
    example into two rows; here one example is one row.)
Plain `.jsonl`, `.jsonl.gz` are read; the format is recognised per record.

On disk (the SFT format): `{prefix}.bin/.idx` is an ordinary Megatron indexed dataset whose every
document is one row of exactly `seq_length` tokens; `{prefix}_prompt_mask.bin/.idx` (uint8) has the
same document lengths and holds 1 at prompt tokens, 0 elsewhere; `{prefix}.meta.json` records the
tokenizer and an `sft` entry (seq_length, packing, counts). A row is prompt + response + EOS, then
(`packing=False`) right-padded with EOS to `seq_length` — the padding is a target, so the model
learns to stop — or (`packing=True`) followed by further whole examples and finally EOS padding.
Examples longer than `seq_length` are dropped and counted, never truncated. Everything is written
under temporary names and published at the end, the token dataset's `.idx` last.
"""
from __future__ import annotations

import gzip
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Iterator

import numpy as np

from megatron_dllm.data.indexed_dataset import (
    IndexedDatasetWriter,
    check_tokenizer_options,
    meta_path,
    optimal_dtype,
    read_metadata,
    tokenizer_metadata,
    validate_indexed_dataset,
)
from megatron_dllm.data.output import claim_outputs, release_all
from megatron_dllm.errors import InputError

MASK_SUFFIX = "_prompt_mask"


def mask_prefix(prefix: str) -> str:
    return prefix + MASK_SUFFIX


# --------------------------------------------------------------------------- reading examples


def render_deng(line: str) -> tuple[str, str]:
    """`question||reasoning #### answer` -> ("Question: q\\n", "Answer: reasoning\\n#### answer")."""
    if "||" not in line or "####" not in line:
        raise InputError("expected 'question||reasoning #### answer'")
    question, rest = line.split("||", 1)
    reasoning, answer = rest.rsplit("####", 1)
    return f"Question: {question.strip()}\n", f"Answer: {reasoning.strip()}\n#### {answer.strip()}"


def render_messages(messages) -> tuple[str, str]:
    """Chat messages -> (prompt, response): the last assistant message is the response."""
    if not isinstance(messages, list) or not messages:
        raise InputError("'messages' must be a non-empty list")
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "assistant" or not isinstance(last.get("content"), str):
        raise InputError("the last message must be {'role': 'assistant', 'content': str}")
    lines = []
    for m in messages[:-1]:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InputError("every message must be {'role': str, 'content': str}")
        lines.append(f"{m['role'].capitalize()}: {m['content']}\n")
    return "".join(lines) + "Assistant: ", last["content"]


def _open_bytes(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def read_examples(path: str, prompt_key: str = "prompt", response_key: str = "response") -> Iterator[tuple[str, str]]:
    """(prompt, response) texts of one input file; a malformed record is a ValueError naming the
    file and line (nothing is skipped silently)."""
    deng = path.endswith(".txt") or path.endswith(".txt.gz")
    with _open_bytes(path) as f:
        for lineno, raw in enumerate(f, 1):
            try:  # decoded per line, so that bad bytes are reported with their line
                line = raw.decode("utf-8").replace("\r\n", "\n")  # as text mode read CRLF files
            except UnicodeDecodeError as err:
                raise InputError(f"{path}:{lineno}: not valid UTF-8 (byte {err.start} of the line)") from None
            if not line.strip():
                continue
            try:
                if deng:
                    yield render_deng(line.rstrip("\n"))
                    continue
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise InputError("expected a JSON object")
                if "messages" in record:
                    yield render_messages(record["messages"])
                elif isinstance(record.get(prompt_key), str) and isinstance(record.get(response_key), str):
                    yield record[prompt_key], record[response_key]
                else:
                    raise InputError(f"expected string fields {prompt_key!r} and {response_key!r}, or 'messages'")
            except (ValueError, json.JSONDecodeError) as err:
                raise InputError(f"{path}:{lineno}: {err}") from None


# --------------------------------------------------------------------------- rows


@dataclass
class SFTStats:
    examples: int = 0
    dropped_too_long: int = 0
    rows: int = 0
    prompt_tokens: int = 0
    response_tokens: int = 0   # response + its EOS
    padding_tokens: int = 0
    inputs: list = field(default_factory=list)

    def summary(self) -> str:
        return (f"{self.examples} examples -> {self.rows} rows ({self.dropped_too_long} dropped: longer than "
                f"the context); tokens: {self.prompt_tokens} prompt, {self.response_tokens} response+EOS, "
                f"{self.padding_tokens} EOS padding")


def build_rows(examples, seq_length: int, eos_id: int, packing: bool, stats: SFTStats):
    """Yield (tokens, prompt_mask) rows of exactly `seq_length` from tokenized (prompt, response)
    examples; the response ends with EOS, rows end with EOS padding."""
    tokens: list[int] = []
    mask: list[int] = []

    def flush():
        pad = seq_length - len(tokens)
        stats.padding_tokens += pad
        stats.rows += 1
        return (np.asarray(tokens + [eos_id] * pad, dtype=np.int64),
                np.asarray(mask + [0] * pad, dtype=np.uint8))

    for prompt, response in examples:
        stats.examples += 1
        response = list(response) + [eos_id]
        n = len(prompt) + len(response)
        if n > seq_length:
            stats.dropped_too_long += 1
            continue
        if tokens and (not packing or len(tokens) + n > seq_length):
            yield flush()
            tokens, mask = [], []
        tokens += list(prompt) + response
        mask += [1] * len(prompt) + [0] * len(response)
        stats.prompt_tokens += len(prompt)
        stats.response_tokens += len(response)
    if tokens:
        yield flush()


def preprocess_sft(inputs: list[str], prefix: str, tokenizer, seq_length: int, packing: bool = False,
                   prompt_key: str = "prompt", response_key: str = "response", overwrite: bool = False) -> SFTStats:
    """Write the SFT dataset `prefix` (see the module docstring) and return its statistics. One
    writer at a time; an existing dataset is replaced only with `overwrite`, once the new one is
    complete."""
    if seq_length < 2:
        raise InputError(f"--seq-length {seq_length}: must be >= 2")
    for path in inputs:
        if not os.path.isfile(path):
            raise InputError(f"--input {path}: no such file")
    locks = claim_outputs([prefix, mask_prefix(prefix)], f"--output-prefix {prefix}", overwrite)
    try:
        return _write(inputs, prefix, tokenizer, seq_length, packing, prompt_key, response_key)
    finally:
        release_all(locks)


def _write(inputs, prefix, tokenizer, seq_length, packing, prompt_key, response_key) -> SFTStats:
    stats = SFTStats(inputs=[os.path.abspath(p) for p in inputs])

    def tokenized():
        for path in inputs:
            for prompt, response in read_examples(path, prompt_key, response_key):
                yield tokenizer.tokenize(prompt), tokenizer.tokenize(response)

    token_writer = IndexedDatasetWriter(prefix, optimal_dtype(tokenizer.vocab_size))
    mask_writer = IndexedDatasetWriter(mask_prefix(prefix), np.uint8)
    try:
        for row, mask in build_rows(tokenized(), seq_length, tokenizer.eod, packing, stats):
            token_writer.add_document(row)
            mask_writer.add_document(mask)
        if stats.rows == 0:
            raise InputError(f"--input: no example fits --seq-length {seq_length} ({stats.examples} read, "
                             f"{stats.dropped_too_long} too long)")
        token_writer.prepare()
        mask_writer.prepare()
        if os.path.exists(prefix + ".idx"):
            os.remove(prefix + ".idx")  # the replaced dataset is gone before its mask changes
        mask_writer.publish()
        token_writer.publish({**tokenizer_metadata(tokenizer),  # last: the token .idx says it is complete
                              "sft": {"seq_length": seq_length, "packing": packing, **asdict(stats)}})
    except BaseException:
        token_writer.abort()
        mask_writer.abort()
        raise
    return stats


# --------------------------------------------------------------------------- validation and reading


def sft_metadata(prefix: str) -> dict | None:
    """The `sft` entry of the sidecar, or None for a dataset that is not in the SFT format."""
    return (read_metadata(prefix) or {}).get("sft")


def validate_sft_dataset(prefix: str) -> dict:
    """Check an SFT dataset: sidecar, both indexed datasets, equal row counts, every row
    `seq_length` long, mask values in {0, 1}, and at least one response token per row. Returns
    the sidecar's `sft` entry; the first problem is a ValueError naming the file."""
    meta = sft_metadata(prefix)
    if meta is None:
        raise InputError(f"{meta_path(prefix)}: no 'sft' entry; expected a dataset written by "
                         f"tools/preprocess_sft_data.py")
    tokens = validate_indexed_dataset(prefix)
    masks = validate_indexed_dataset(mask_prefix(prefix))
    if np.dtype(masks.dtype) != np.uint8:
        raise InputError(f"{mask_prefix(prefix)}.idx: prompt mask dtype {masks.dtype}, expected uint8")
    if tokens.sequence_count != masks.sequence_count or tokens.num_tokens != masks.num_tokens:
        raise InputError(f"{mask_prefix(prefix)}.idx: {masks.sequence_count} rows / {masks.num_tokens} tokens, "
                         f"but {prefix}.idx has {tokens.sequence_count} / {tokens.num_tokens}")
    length = meta["seq_length"]
    if tokens.num_tokens != tokens.sequence_count * length:
        raise InputError(f"{prefix}.idx: {tokens.num_tokens} tokens in {tokens.sequence_count} rows, "
                         f"expected rows of exactly {length} tokens")
    mask = np.memmap(mask_prefix(prefix) + ".bin", dtype=np.uint8, mode="r").reshape(-1, length)
    if mask.size and int(mask.max()) > 1:
        raise InputError(f"{mask_prefix(prefix)}.bin: values other than 0/1")
    no_response = np.flatnonzero(mask.sum(1) == length)
    if no_response.size:
        raise InputError(f"{mask_prefix(prefix)}.bin: row {int(no_response[0])} has no response token")
    return meta


class SFTRows:
    """The rows of an SFT dataset in memory-mapped form: `tokens(i)`, `prompt_mask(i)` (both [L])."""

    def __init__(self, prefix: str):
        self.meta = validate_sft_dataset(prefix)
        self.prefix, self.length = prefix, self.meta["seq_length"]
        self.eos = int(read_metadata(prefix)["eod"])
        dtype = validate_indexed_dataset(prefix).dtype
        self._tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r").reshape(-1, self.length)
        self._mask = np.memmap(mask_prefix(prefix) + ".bin", dtype=np.uint8, mode="r").reshape(-1, self.length)

    def __len__(self) -> int:
        return self._tokens.shape[0]

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self._tokens[i].astype(np.int64), self._mask[i].astype(bool)


class SFTSamples:
    """Training/validation samples over a range of rows, in epochs: sample i is row
    perm_e[i mod n] of epoch e = i // n, with perm_e a permutation seeded by (seed, e); so a
    resumed run (or one with another DP size) reads exactly the same rows.

    `sample(i)` gives (tokens, prompt_mask) of length L, or L + 1 with `extra_token` (AR reads
    inputs x[:-1], targets x[1:]; the extra token is EOS padding and counts as a target).
    """

    prompt_mask = True  # BatchSchedule: samples come with a prompt mask

    def __init__(self, rows: SFTRows, lo: int, hi: int, seed: int, extra_token: bool, shuffle: bool = True):
        if hi <= lo:
            raise InputError(f"{rows.prefix}: the row range [{lo}, {hi}) is empty")
        self.rows, self.lo, self.n, self.seed = rows, lo, hi - lo, seed
        self.extra_token, self.shuffle = extra_token, shuffle
        self._perm = {}

    @property
    def num_rows(self) -> int:
        return self.n

    def __len__(self) -> int:  # any sample index is valid: epochs repeat
        return 2**62

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm:
            if len(self._perm) > 2:
                self._perm.clear()
            rng = np.random.default_rng([self.seed, epoch])
            self._perm[epoch] = rng.permutation(self.n) if self.shuffle else np.arange(self.n)
        return self._perm[epoch]

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        epoch, j = divmod(int(i), self.n)
        tokens, mask = self.rows.row(self.lo + int(self._order(epoch)[j]))
        if self.extra_token:
            tokens = np.append(tokens, self.rows.eos)
            mask = np.append(mask, False)
        return tokens, mask


def split_rows(n: int, split: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """Megatron's --split weights ('969,30,1') -> (train, valid) row ranges of n rows."""
    weights = [float(w) for w in split.replace("/", ",").split(",")]
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + w / total)
    edges = [int(round(b * n)) for b in bounds]
    return (edges[0], edges[1]), (edges[1], edges[2])


def build_sft_datasets(data_path: list[str], split: str, valid_data_path: list[str] | None, seq_length: int,
                       extra_token: bool, seed: int, tokenizer, with_valid: bool):
    """(train, valid or None) SFTSamples from one SFT prefix (+ an optional held-out prefix)."""
    if len(data_path) != 1 or (valid_data_path and len(valid_data_path) != 1):
        raise InputError("--sft reads one SFT dataset prefix per split (no blends)")
    rows = SFTRows(data_path[0])
    _check(rows, seq_length, tokenizer, "--data-path")
    if valid_data_path:
        valid_rows = SFTRows(valid_data_path[0])
        _check(valid_rows, seq_length, tokenizer, "--valid-data-path")
        train = SFTSamples(rows, 0, len(rows), seed, extra_token)
        valid = SFTSamples(valid_rows, 0, len(valid_rows), seed, extra_token, shuffle=False)
    else:
        (tlo, thi), (vlo, vhi) = split_rows(len(rows), split)
        train = SFTSamples(rows, tlo, thi, seed, extra_token)
        if with_valid and vhi <= vlo:
            raise InputError(f"--split {split} leaves no held-out rows of {data_path[0]} ({len(rows)} rows): "
                             f"change --split or give --valid-data-path")
        valid = SFTSamples(rows, vlo, vhi, seed, extra_token, shuffle=False) if with_valid else None
    return train, valid


def _check(rows: SFTRows, seq_length: int, tokenizer, flag: str) -> None:
    if rows.length != seq_length:
        raise InputError(f"{flag}: {rows.prefix} holds rows of {rows.length} tokens, but --seq-length is "
                         f"{seq_length} (preprocess with the run's --seq-length)")
    made = read_metadata(rows.prefix) or {}
    check_tokenizer_options(rows.prefix, made, tokenizer, flag)
    if made.get("tokenizer_sha256") and made["tokenizer_sha256"] != tokenizer_metadata(tokenizer)["tokenizer_sha256"]:
        raise InputError(f"{flag}: {rows.prefix} was preprocessed with another tokenizer "
                         f"({made.get('tokenizer_model')}); give the tokenizer the data was made with")
