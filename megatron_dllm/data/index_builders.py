"""Sample and blending index builders: C++ (`megatron_dllm._index_builders`) with numpy references.

Both produce exactly what megatron-core 0.16.1's `helpers_cpp` produces, same dtype included, so
cache files written by either are interchangeable:

- `build_sample_idx`: GPTDataset's sample index, `[num_samples + 1, 2]` rows of (position in the
  document index, token offset into that document). Row k >= 1 marks global token k * seq_length
  of the epoch-concatenated, document-index-ordered stream, stored against the document whose
  token range (C_j, C_{j+1}] holds the sample end k * seq_length + add_extra (C = prefix sums of
  the lengths). int32 when max(len(document_index), max(sizes)) fits, else int64 (megatron's rule).
- `build_blending_indices`: BlendedDataset's greedy max-error blend (dataset_index int16,
  dataset_sample_index int64, filled in place), and `build_exhaustive_blending_indices`.

The public functions take `backend=` "auto" (C++ when the extension imports, else megatron-core's
own compiled helpers_cpp, which ships with it and is far faster than numpy), "cpp", "numpy" or
"megatron"; the default comes from `MEGATRON_DLLM_INDEX_BACKEND` (default "auto").
`MEGATRON_DLLM_INDEX_THREADS` caps the C++ threads (default: all cores).

`megatron_helpers_replaced()` is the hook into megatron-core: GPTDataset and BlendedDataset
import `megatron.core.datasets.helpers` when they build, so swapping its two functions for the
duration of that call makes megatron's own build-and-cache code use these builders.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Optional, Sequence

import numpy as np

from megatron_dllm.errors import InputError

try:
    from megatron_dllm import _index_builders as _cpp
except ImportError:  # extension not built: megatron-core's helpers_cpp serve
    _cpp = None

HAVE_CPP = _cpp is not None
BACKENDS = ("auto", "cpp", "numpy", "megatron")


def _backend(backend: Optional[str]) -> str:
    backend = backend or os.environ.get("MEGATRON_DLLM_INDEX_BACKEND", "auto")
    if backend not in BACKENDS:
        raise InputError(f"index builder backend {backend!r}: expected one of {BACKENDS}")
    if backend == "auto":
        return "cpp" if HAVE_CPP else "megatron"
    if backend == "cpp" and not HAVE_CPP:
        raise RuntimeError("megatron_dllm._index_builders is not built "
                           "(pip install -e . --no-build-isolation --no-deps)")
    return backend


def backend_in_words() -> str:
    """The builders in use (auto, or MEGATRON_DLLM_INDEX_BACKEND), for logs."""
    backend = _backend(None)
    if backend == "megatron":
        return "megatron-core's helpers_cpp" + ("" if HAVE_CPP else " (extension not built)")
    return {"cpp": "C++", "numpy": "numpy (reference)"}[backend]


def _num_threads() -> int:
    return int(os.environ.get("MEGATRON_DLLM_INDEX_THREADS", "0"))


# ----------------------------------------------------------------------------------------------
# Sample index
# ----------------------------------------------------------------------------------------------

def num_samples(sequence_length: int, num_epochs: int, tokens_per_epoch: int,
                drop_last_partial_sequence: bool, add_extra_token_to_sequence: bool) -> int:
    """Megatron's sample count, including the float32 rounding of its ceil branch."""
    extra = int(bool(add_extra_token_to_sequence))
    total = int(num_epochs) * int(tokens_per_epoch) - extra
    if drop_last_partial_sequence:
        return total // int(sequence_length)
    return int(np.ceil(np.float32(total) / np.float32(sequence_length)))


def sample_idx_dtype(sizes: np.ndarray, document_indices: np.ndarray):
    sample_idx_max = max(document_indices.shape[0], int(sizes.max()))
    return np.int32 if sample_idx_max <= np.iinfo(np.int32).max else np.int64


def build_sample_idx_numpy(sizes, document_indices, sequence_length, num_epochs, tokens_per_epoch,
                           drop_last_partial_sequence=True, add_extra_token_to_sequence=True,
                           chunk: int = 1 << 22) -> np.ndarray:
    """Reference: prefix sums of the document lengths + `searchsorted` of the sample ends."""
    sizes = np.asarray(sizes)
    document_indices = np.asarray(document_indices)
    seq = int(sequence_length)
    if seq <= 1 or num_epochs <= 0 or tokens_per_epoch <= 1 or len(document_indices) == 0:
        raise ValueError("build_sample_idx: needs seq_length > 1, num_epochs > 0, "
                         "tokens_per_epoch > 1 and a non-empty document index")
    extra = int(bool(add_extra_token_to_sequence))
    n = num_samples(seq, num_epochs, tokens_per_epoch, drop_last_partial_sequence, extra)
    dtype = sample_idx_dtype(sizes, document_indices)
    lengths = sizes[document_indices].astype(np.int64)
    num_docs = len(lengths)
    bounds = np.zeros(num_docs + 1, dtype=np.int64)
    np.cumsum(lengths, out=bounds[1:])
    out = np.empty((n + 1, 2), dtype=dtype)
    out[0] = 0
    for lo in range(1, n + 1, chunk):
        starts = np.arange(lo, min(lo + chunk, n + 1), dtype=np.int64) * seq
        # first i with bounds[i] >= end; the sample end lies in document i - 1
        doc = np.searchsorted(bounds, starts + extra, side="left") - 1
        past = doc == num_docs  # end beyond the stream (drop_last_partial_sequence=False)
        doc[past] = num_docs - 1
        offset = starts - bounds[doc]
        offset[past] = lengths[-1] - extra
        out[lo:lo + len(starts), 0] = doc
        out[lo:lo + len(starts), 1] = offset
    return out


def build_sample_idx(sizes, document_indices, sequence_length, num_epochs, tokens_per_epoch,
                     drop_last_partial_sequence=True, add_extra_token_to_sequence=True,
                     backend: Optional[str] = None) -> np.ndarray:
    """Drop-in for `megatron.core.datasets.helpers.build_sample_idx` (same arguments, output, dtype)."""
    backend = _backend(backend)
    if sequence_length <= 1 or tokens_per_epoch <= 1:  # a 1-token sample or split: the builders here need 2
        backend = "megatron"
    args = (sequence_length, num_epochs, tokens_per_epoch, drop_last_partial_sequence)
    if backend == "numpy":
        return build_sample_idx_numpy(sizes, document_indices, *args, add_extra_token_to_sequence)
    if backend == "megatron":
        from megatron.core.datasets.helpers_cpp import build_sample_idx_int32, build_sample_idx_int64
        fn = build_sample_idx_int32 if sample_idx_dtype(sizes, document_indices) == np.int32 \
            else build_sample_idx_int64
        return fn(sizes, document_indices, *args, int(bool(add_extra_token_to_sequence)))
    fn = _cpp.build_sample_idx_int32 if sample_idx_dtype(sizes, document_indices) == np.int32 \
        else _cpp.build_sample_idx_int64
    return fn(sizes, document_indices, *args, int(bool(add_extra_token_to_sequence)), _num_threads())


# ----------------------------------------------------------------------------------------------
# Blending indices
# ----------------------------------------------------------------------------------------------

def _most_behind(w: list, counts: list, s: int, candidates) -> int:
    """Megatron's greedy pick at step s: the dataset furthest below its share, the first on ties."""
    sd = float(s) if s > 1 else 1.0
    return max(candidates, key=lambda i: w[i] * sd - counts[i])


def build_blending_indices_numpy(dataset_index: np.ndarray, dataset_sample_index: np.ndarray,
                                 weights: Sequence[float], num_datasets: int, size: int,
                                 verbose: bool = False) -> None:
    """Reference: megatron's greedy, step by step, in Python floats (IEEE doubles like C++)."""
    w = [float(x) for x in list(weights)[:num_datasets]]
    counts = [0] * num_datasets
    choice = np.empty(size, dtype=np.int16)
    within = np.empty(size, dtype=np.int64)
    for s in range(size):
        best = _most_behind(w, counts, s, range(num_datasets))
        choice[s] = best
        within[s] = counts[best]
        counts[best] += 1
    dataset_index[:size] = choice
    dataset_sample_index[:size] = within
    if verbose:
        print("> sample ratios:", [c / size for c in counts])


def build_blending_indices(dataset_index: np.ndarray, dataset_sample_index: np.ndarray,
                           weights: Sequence[float], num_datasets: int, size: int,
                           verbose: bool = False, backend: Optional[str] = None) -> None:
    """Drop-in for `helpers.build_blending_indices`: fills int16 `dataset_index` and int64
    `dataset_sample_index` in place."""
    backend = _backend(backend)
    if backend == "numpy":
        return build_blending_indices_numpy(dataset_index, dataset_sample_index, weights,
                                            num_datasets, size, verbose)
    if backend == "megatron":
        from megatron.core.datasets import helpers_cpp
        return helpers_cpp.build_blending_indices(dataset_index, dataset_sample_index, weights,
                                                  num_datasets, size, verbose)
    _cpp.build_blending_indices(dataset_index, dataset_sample_index,
                                np.asarray(weights, dtype=np.float64), num_datasets, size,
                                verbose, _num_threads())


def build_exhaustive_blending_indices_numpy(dataset_index, dataset_sample_index, sizes,
                                            num_datasets) -> None:
    sizes = [int(x) for x in list(sizes)[:num_datasets]]
    total = sum(sizes)
    w = [x / float(total) for x in sizes]
    counts = [0] * num_datasets
    unspent = list(range(num_datasets))  # kept ascending, like megatron's std::set
    s = 0
    while unspent:
        best = _most_behind(w, counts, s, unspent)
        dataset_index[s] = best
        dataset_sample_index[s] = counts[best]
        counts[best] += 1
        if sizes[best] - float(counts[best]) == 0:
            unspent.remove(best)
        s += 1


def build_exhaustive_blending_indices(dataset_index, dataset_sample_index, sizes, num_datasets,
                                      backend: Optional[str] = None) -> None:
    """Drop-in for `helpers.build_exhaustive_blending_indices` (exactly sizes[i] from dataset i)."""
    backend = _backend(backend)
    if backend == "numpy":
        return build_exhaustive_blending_indices_numpy(dataset_index, dataset_sample_index, sizes,
                                                       num_datasets)
    if backend == "megatron":
        from megatron.core.datasets import helpers_cpp
        return helpers_cpp.build_exhaustive_blending_indices(dataset_index, dataset_sample_index,
                                                             sizes, num_datasets)
    _cpp.build_exhaustive_blending_indices(dataset_index, dataset_sample_index,
                                           np.asarray(sizes, dtype=np.int64), num_datasets)


# ----------------------------------------------------------------------------------------------
# Hook into megatron-core
# ----------------------------------------------------------------------------------------------

_REPLACED = {
    "build_sample_idx": build_sample_idx,
    "build_blending_indices": build_blending_indices,
    "build_exhaustive_blending_indices": build_exhaustive_blending_indices,
}
_lock = threading.Lock()
_depth = 0
_saved: dict = {}


@contextlib.contextmanager
def megatron_helpers_replaced():
    """While active, `megatron.core.datasets.helpers.{build_sample_idx, build_blending_indices,
    build_exhaustive_blending_indices}` are ours. Re-entrant and safe under megatron's dataset
    builder threads (counted; the originals return when the last user leaves). Our outputs equal
    megatron's, so another thread calling the helpers meanwhile gets the same answer."""
    global _depth
    from megatron.core.datasets import helpers

    with _lock:
        if _depth == 0:
            for name, fn in _REPLACED.items():
                _saved[name] = getattr(helpers, name)
                setattr(helpers, name, fn)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for name in _REPLACED:
                    setattr(helpers, name, _saved.pop(name))
