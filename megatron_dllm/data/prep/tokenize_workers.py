"""Preprocessing stage 2, between the readers (`sources.iter_chunks`) and the writer
(`preprocess_writer`): tokenizer workers turn each chunk of raw records into, per key, one token
array, the document lengths and the rejected records with their reason.

Records arrive undecoded and are decoded strictly here, so a bad record is rejected with its line
(invalid_utf8, invalid_json, missing_key — absent or null —, not_text, empty_text), never dropped.
With `workers > 1` chunks are tokenized by a spawned process pool, at most `2 * workers + 2` in
flight, and come back in input order: the output is identical for any worker count. The pool's
workers end when the preprocessing process dies, even by SIGKILL (`parent_watch`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from collections import deque
from typing import Iterator, Sequence

import numpy as np

from megatron_dllm.errors import InputError

MAX_SEEN_KEYS = 50  # field names remembered to name in a "no record has key" error


_worker = {}  # per process: the tokenizer, built once


def _init_worker(tok, json_keys: Sequence[str], append_eod: bool, dtype_name: str) -> None:
    """`tok` is the built tokenizer (pickled to a worker: rebuilt from its file, or from its
    tables for a Megatron JSON TikTokenizer)."""
    # a mask piece of the model's own vocabulary (SentencePiece's <mask>, a JSON vocabulary's):
    # text that spells it encodes to it, and no diffusion model can learn to predict [MASK]
    own_mask = None if getattr(tok, "mask_appended", True) else tok.mask_id
    _worker.update(tok=tok, keys=list(json_keys), eod=tok.eod if append_eod else None,
                   dtype=np.dtype(dtype_name), mask=own_mask)


@contextlib.contextmanager
def _children_block_ctrl_c():
    """Processes started in this block never receive SIGINT: it is blocked here, and a blocked
    signal stays blocked across exec (Python does not unblock it). A Ctrl-C, which reaches the
    whole process group, then interrupts only this process (held pending while blocked, it is
    delivered as the block ends, never lost), which stops the pool; no worker prints a traceback."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _init_pool_worker(parent: int, *init_args) -> None:
    """A pool worker: ends when the preprocessing process dies (even by SIGKILL), then builds
    the tokenizer. A parent already gone before the watch starts is caught here."""
    from megatron_dllm.parent_watch import exit_when_parent_dies

    if os.getppid() != parent:
        os._exit(1)
    exit_when_parent_dies("preprocessing worker")
    _init_worker(*init_args)


def _values(kind: str, payload, keys):
    """-> dict of field values, or a reject reason for the whole record."""
    if kind == "parquet":
        return payload
    try:
        # a file written as utf-8-sig (Windows tools) starts with a byte-order mark: a marker, not text
        text = payload.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError:
        return "invalid_utf8"
    if kind == "text":
        return {keys[0]: text.replace("\r\n", "\n")}
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested too deeply to parse
        return "invalid_json"
    return obj if isinstance(obj, dict) else "invalid_json"


def has_surrogates(pieces) -> bool:
    """Whether any of the strings holds a lone surrogate (from a JSON `\\ud800` escape): not
    Unicode text, and tokenizers differ on it (SentencePiece raises, tiktoken writes U+FFFD)."""
    try:
        for t in pieces:
            t.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _encode_chunk(records):
    """Tokenize one chunk -> ({key: (tokens array, int64 lengths, [(fi, pos, reason)])}, n records,
    some of the field names seen)."""
    tok, keys, eod, dtype, mask = (_worker[k] for k in ("tok", "keys", "eod", "dtype", "mask"))
    ids = {k: [] for k in keys}
    lengths = {k: [] for k in keys}
    rejects = {k: [] for k in keys}
    seen = set()
    for fi, pos, kind, payload in records:
        values = _values(kind, payload, keys)
        if len(seen) < MAX_SEEN_KEYS and isinstance(values, dict):
            seen.update(map(str, values))
        for key in keys:
            if isinstance(values, str):
                rejects[key].append((fi, pos, values))
                continue
            text = values.get(key)
            if text is None:  # absent or null
                rejects[key].append((fi, pos, "missing_key"))
                continue
            if isinstance(text, bytes):  # a Parquet binary column
                try:
                    text = text.decode("utf-8")
                except UnicodeDecodeError:
                    rejects[key].append((fi, pos, "invalid_utf8"))
                    continue
            # Megatron's document mode: a list of strings is tokenized piecewise and concatenated.
            pieces = [text] if isinstance(text, str) else text
            if not isinstance(pieces, list) or not all(isinstance(t, str) for t in pieces):
                rejects[key].append((fi, pos, "not_text"))
                continue
            if has_surrogates(pieces):  # checked first: the same records are kept whatever the tokenizer
                rejects[key].append((fi, pos, "invalid_utf8"))
                continue
            if not any(t.strip() for t in pieces):
                doc = []
            elif len(pieces) == 1:  # the common case: no per-id Python loop
                doc = tok.tokenize(pieces[0])
            else:  # every item, whitespace too (a paragraph break), as Megatron-LM's encoder
                doc = [i for t in pieces for i in tok.tokenize(t)]
            if not doc:
                rejects[key].append((fi, pos, "empty_text"))
                continue
            if mask is not None and mask in doc:
                rejects[key].append((fi, pos, "mask_token"))
                continue
            if eod is not None:
                doc.append(eod)
            ids[key].extend(doc)
            lengths[key].append(len(doc))
    out = {k: (np.array(ids[k], dtype=dtype), np.array(lengths[k], dtype=np.int64), rejects[k])
           for k in keys}
    return out, len(records), seen


def encoded_chunks(chunks, tokenizer, json_keys: Sequence[str], append_eod: bool, dtype: np.dtype,
                   workers: int) -> Iterator[tuple]:
    """Yield ((per key (tokens, lengths, rejects), records, field names seen), source Chunk without
    its records) in input order; at most `2 * workers + 2` chunks are submitted and not yet consumed."""
    init_args = (tokenizer, list(json_keys), append_eod, np.dtype(dtype).name)
    max_inflight = 2 * workers + 2
    if workers <= 1:
        _init_worker(*init_args)
        for chunk in chunks:
            result = _encode_chunk(chunk.records)
            chunk.records = None
            yield result, chunk
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    # spawn: the parent may hold threads (pyarrow, tokenizers) that fork would copy mid-lock
    ex = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_init_pool_worker, initargs=(os.getpid(), *init_args))
    pending = deque()
    try:
        for chunk in chunks:
            with _children_block_ctrl_c():  # workers start inside submit
                pending.append((ex.submit(_encode_chunk, chunk.records), chunk))
            chunk.records = None
            while len(pending) >= max_inflight:
                fut, c = pending.popleft()
                yield fut.result(), c
        while pending:
            fut, c = pending.popleft()
            yield fut.result(), c
    except BrokenProcessPool:  # the writer removes its temporaries: nothing is published
        raise InputError("a tokenizer worker died (killed, or out of memory: fewer --workers or a smaller "
                         "--chunk-bytes?); nothing was published, run it again") from None
    finally:
        for fut, _ in pending:
            fut.cancel()
        ex.shutdown(wait=True, cancel_futures=True)
