"""Supervised fine-tuning data at run time: the SFT format on disk, its validation, and the
epoch-ordered samples training reads. Writing it: `prep/sft_preprocess.py`.

On disk (the SFT format): `{prefix}.bin/.idx` is an ordinary Megatron indexed dataset whose every
document is one row of exactly `seq_length` tokens; `{prefix}_prompt_mask.bin/.idx` (uint8) has the
same document lengths and holds 1 at prompt tokens, 0 elsewhere; `{prefix}.meta.json` records the
tokenizer and an `sft` entry (seq_length, packing, counts). How rows are filled (EOS padding,
packing, dropped examples): `prep/sft_preprocess.py`.
"""
from __future__ import annotations

import numpy as np

from megatron_dllm.data.indexed_dataset import (
    check_tokenizer_options,
    meta_path,
    read_metadata,
    tokenizer_metadata,
    validate_indexed_dataset,
)

MASK_SUFFIX = "_prompt_mask"


def mask_prefix(prefix: str) -> str:
    return prefix + MASK_SUFFIX


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
        raise ValueError(f"{meta_path(prefix)}: no 'sft' entry; expected a dataset written by "
                         f"tools/preprocess_sft_data.py")
    tokens = validate_indexed_dataset(prefix)
    masks = validate_indexed_dataset(mask_prefix(prefix))
    if np.dtype(masks.dtype) != np.uint8:
        raise ValueError(f"{mask_prefix(prefix)}.idx: prompt mask dtype {masks.dtype}, expected uint8")
    if tokens.sequence_count != masks.sequence_count or tokens.num_tokens != masks.num_tokens:
        raise ValueError(f"{mask_prefix(prefix)}.idx: {masks.sequence_count} rows / {masks.num_tokens} tokens, "
                         f"but {prefix}.idx has {tokens.sequence_count} / {tokens.num_tokens}")
    length = meta["seq_length"]
    if tokens.num_tokens != tokens.sequence_count * length:
        raise ValueError(f"{prefix}.idx: {tokens.num_tokens} tokens in {tokens.sequence_count} rows, "
                         f"expected rows of exactly {length} tokens")
    mask = np.memmap(mask_prefix(prefix) + ".bin", dtype=np.uint8, mode="r").reshape(-1, length)
    if mask.size and int(mask.max()) > 1:
        raise ValueError(f"{mask_prefix(prefix)}.bin: values other than 0/1")
    no_response = np.flatnonzero(mask.sum(1) == length)
    if no_response.size:
        raise ValueError(f"{mask_prefix(prefix)}.bin: row {int(no_response[0])} has no response token")
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
            raise ValueError(f"{rows.prefix}: the row range [{lo}, {hi}) is empty")
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
        raise ValueError("--sft reads one SFT dataset prefix per split (no blends)")
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
            raise ValueError(f"--split {split} leaves no held-out rows of {data_path[0]} ({len(rows)} rows): "
                             f"change --split or give --valid-data-path")
        valid = SFTSamples(rows, vlo, vhi, seed, extra_token, shuffle=False) if with_valid else None
    return train, valid


def _check(rows: SFTRows, seq_length: int, tokenizer, flag: str) -> None:
    if rows.length != seq_length:
        raise ValueError(f"{flag}: {rows.prefix} holds rows of {rows.length} tokens, but --seq-length is "
                         f"{seq_length} (preprocess with the run's --seq-length)")
    made = read_metadata(rows.prefix) or {}
    check_tokenizer_options(rows.prefix, made, tokenizer, flag)
    if made.get("tokenizer_sha256") and made["tokenizer_sha256"] != tokenizer_metadata(tokenizer)["tokenizer_sha256"]:
        raise ValueError(f"{flag}: {rows.prefix} was preprocessed with another tokenizer "
                         f"({made.get('tokenizer_model')}); give the tokenizer the data was made with")
