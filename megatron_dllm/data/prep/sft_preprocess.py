"""Supervised fine-tuning data, offline: prompt/response examples -> fixed-length Megatron rows + prompt
mask, written in the SFT format (described and read by `data/sft.py`).

Inputs (one example per record):
  - JSONL with `prompt` / `response` fields (other names: `prompt_key`, `response_key`);
  - JSONL with a chat-style `messages` list ([{role, content}, ...]): the last assistant message is
    the response, everything before it the prompt, rendered "Role: content" per line and ending
    with "Assistant: ";
  - Deng et al.'s augmented GSM8K text (`.txt`, `question||reasoning #### answer` per line),
    rendered as the masked-diffusion SFT recipes do (SMDM, sft/gsm8k_data.py): prompt
    "Question: q\\n", response "Answer: reasoning\\n#### answer". (SMDM additionally splits each
    example into two rows; here one example is one row.)
Plain, `.gz` and `.zst` files are read; the format is recognised per record.

Output: rows of exactly `seq_length` tokens, each with its prompt mask (the files: `data/sft.py`).
A row is prompt + response + EOS, then
(`packing=False`) right-padded with EOS to `seq_length` — the padding is a target, so the model
learns to stop — or (`packing=True`) followed by further whole examples and finally EOS padding.
Examples longer than `seq_length` are dropped and counted, never truncated. Everything is written
under temporary names and published at the end, the token dataset's `.idx` last.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, Optional

import numpy as np

from megatron_dllm.data.indexed_dataset import optimal_dtype, tokenizer_metadata
from megatron_dllm.data.prep.dataset_writer import IndexedDatasetWriter
from megatron_dllm.data.prep.output import DATASET_SUFFIXES, claim_outputs, release_all, remove_stale_temporaries
from megatron_dllm.data.prep.sources import base_name, expand_inputs, read_lines
from megatron_dllm.data.prep.tokenize_workers import has_surrogates
from megatron_dllm.data.sft import mask_prefix
from megatron_dllm.errors import InputError

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


def read_examples(path: str, prompt_key: str = "prompt", response_key: str = "response") -> Iterator[tuple[str, str]]:
    """(prompt, response) texts of one input file; a malformed record is a ValueError naming the
    file and line (nothing is skipped silently)."""
    deng = base_name(path).endswith(".txt")
    for lineno, raw, _ in read_lines(path):  # a truncated or corrupt .gz / .zst is an InputError
        try:  # decoded per line, so that bad bytes are reported with their line
            # as text mode reads CRLF files; a byte-order mark (utf-8-sig) is a marker, not text
            line = raw.decode("utf-8").removeprefix("\ufeff").replace("\r\n", "\n")
        except UnicodeDecodeError as err:
            raise InputError(f"{path}:{lineno}: not valid UTF-8 (byte {err.start} of the line)") from None
        if not line.strip():
            continue
        try:
            if deng:
                example = render_deng(line.rstrip("\n"))
            else:
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise InputError("expected a JSON object")
                if "messages" in record:
                    example = render_messages(record["messages"])
                elif isinstance(record.get(prompt_key), str) and isinstance(record.get(response_key), str):
                    example = record[prompt_key], record[response_key]
                else:
                    raise InputError(f"expected string fields {prompt_key!r} and {response_key!r}, or 'messages'")
        except ValueError as err:  # json.JSONDecodeError included
            raise InputError(f"{path}:{lineno}: {err}") from None
        except RecursionError:
            raise InputError(f"{path}:{lineno}: JSON nested too deeply to parse") from None
        if has_surrogates(example):
            raise InputError(f"{path}:{lineno}: a lone surrogate (a JSON \\ud800-\\udfff escape), expected "
                             f"valid Unicode text")
        yield example


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
                   prompt_key: str = "prompt", response_key: str = "response", overwrite: bool = False,
                   log: Optional[Callable[[str], None]] = None) -> SFTStats:
    """Write the SFT dataset `prefix` (see the module docstring) and return its statistics. One
    writer at a time; an existing dataset is replaced only with `overwrite`, once the new one is
    complete. `log` (default: stderr) reports the removed temporaries of an interrupted run."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if seq_length < 2:
        raise InputError(f"--seq-length {seq_length}: must be >= 2")
    if prompt_key == response_key:
        raise InputError(f"--prompt-key and --response-key are both {prompt_key!r}; a prompt and its response are "
                         f"two fields")
    inputs = expand_inputs(inputs, in_given_order=True)  # rows follow the inputs' order
    prefixes = [prefix, mask_prefix(prefix)]
    locks = claim_outputs(prefixes, f"--output-prefix {prefix}", overwrite)
    try:
        remove_stale_temporaries([p + s for p in prefixes for s in DATASET_SUFFIXES], log)
        return _write(inputs, prefix, tokenizer, seq_length, packing, prompt_key, response_key)
    finally:
        release_all(locks)


def _write(inputs, prefix, tokenizer, seq_length, packing, prompt_key, response_key) -> SFTStats:
    stats = SFTStats(inputs=[os.path.abspath(p) for p in inputs])

    own_mask = None if getattr(tokenizer, "mask_appended", True) else tokenizer.mask_id

    def tokenized():
        for path in inputs:
            for prompt, response in read_examples(path, prompt_key, response_key):
                pair = tokenizer.tokenize(prompt), tokenizer.tokenize(response)
                if own_mask is not None and any(own_mask in ids for ids in pair):  # as preprocess_data's mask_token
                    raise InputError(f"{path}: the example {(prompt + response)[:60]!r} spells the tokenizer's mask "
                                     f"piece (id {own_mask}), which no diffusion model can learn to predict; remove it")
                yield pair

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
