"""Train/valid token datasets on megatron-core's BlendedMegatronDatasetBuilder + GPTDataset.

EOD/BOS convention: documents are stored back to back, each ended by the tokenizer's EOD
(= EOS) id when preprocessed with `--append-eod`; no BOS is ever added. A sample is a window
of the shuffled document stream and may cross document boundaries (no attention reset).

A sample is `seq_length + 1` tokens when `add_extra_token=True` (AR: inputs/labels are the
shifted halves) and exactly `seq_length` tokens when False (diffusion: no label shift).
`ds[i]` is a 1-D int64 numpy array; no attention masks or position ids are built here.

Index caches (`document/sample/shuffle_index.npy`, and a blend's `dataset_index.npy` /
`dataset_sample_index.npy`) are megatron-core's files and names, under `cache_path` (default:
`<directory of the first prefix>/cache`). Megatron's own build-and-cache code writes them, but the
sample and blending indices inside come from `megatron_dllm.data.index_builders` (C++, multi-
threaded, output-identical to megatron's helpers_cpp, so either side's caches load in the other).
With torch.distributed initialised, megatron-core builds them on rank 0 first and the other ranks
load them after a barrier, so `build_datasets` must then be called on every rank; without it, the
caller just builds.

Index caches never unpickle: megatron-core 0.16.1 reads them with `numpy.load(...,
allow_pickle=True)`, which runs the code in a crafted cache file (a pickle, or an object array,
named `*-sample_index.npy`). Importing this module gives megatron's dataset modules a `numpy`
whose `load` is `load_index_cache` (allow_pickle=False; a refused file raises ValueError naming it),
and whose `save` publishes each cache file whole (`save_index_cache`), so that jobs sharing a cache
directory never read a file another is writing.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import types
from collections import OrderedDict
from contextlib import contextmanager
from functools import partial
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
from megatron.core.datasets import blended_dataset, gpt_dataset, masked_dataset
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from megatron_dllm import platform
from megatron_dllm.atomic_file import atomic_write
from megatron_dllm.data.index_builders import megatron_helpers_replaced
from megatron_dllm.data.indexed_dataset import (
    HEADER_SIZE,
    check_made_with,
    read_metadata,
    scan_tokens,
    validate_indexed_dataset,
)
from megatron_dllm.data.tokenizers import data_id_rule
from megatron_dllm.errors import InputError

Blend = Tuple[List[str], Optional[List[float]]]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_data_path(data_path: Sequence[str], flag: str = "--data-path") -> Blend:
    """Megatron's `prefix` | `p1 p2 ...` | `w1 p1 w2 p2 ...` -> (prefixes, weights or None)."""
    items = [str(x) for x in data_path]
    if not items:
        raise InputError(f"{flag}: no dataset prefix given")
    if len(items) % 2 and len(items) > 1 and _is_number(items[0]):
        raise InputError(f"{flag}: {len(items)} items, starting with the weight {items[0]}: a weighted blend is "
                         f"pairs of weight and prefix")
    if len(items) % 2 == 0 and all(_is_number(w) for w in items[0::2]):
        weights = [float(w) for w in items[0::2]]
        if not all(math.isfinite(w) and w > 0 for w in weights):
            raise InputError(f"{flag}: weights must be positive finite numbers, got {weights}")
        return items[1::2], weights
    return items, None


def load_index_cache(file, mmap_mode=None, allow_pickle=False, **kwargs):
    """`numpy.load` of an index cache that never unpickles, whatever `allow_pickle` the caller
    passes. A file that is not a plain numeric .npy (a pickle, an object array, a truncated
    file) raises ValueError naming it."""
    try:
        return np.load(file, mmap_mode=mmap_mode, allow_pickle=False, **kwargs)
    except (ValueError, EOFError) as err:  # EOFError: an empty file
        why = str(err)
        if "pickle" in why or "Python objects" in why:  # numpy's advice here would be to unpickle it
            why = "it holds pickled Python objects, which are never loaded"
        raise InputError(f"index cache {file}: {why}; expected a numeric .npy as megatron-core writes "
                         f"it (delete the file to have it rebuilt)") from None


def save_index_cache(file: str, arr, **kwargs) -> None:
    """`numpy.save` of an index cache, published whole: written under a name of its own, then
    renamed into place. megatron-core's build writes the files in place, so a second job sharing
    the cache directory (a sweep's runs starting together) could find them all present and load
    one that was still being written, or that a third job had just truncated to rewrite it."""
    with atomic_write(file, "wb") as f:
        np.save(f, arr, **kwargs)


class _NumpyWithoutPickle(types.ModuleType):
    """numpy, except `load` and `save` (see `load_index_cache` and `save_index_cache`)."""

    load = staticmethod(load_index_cache)
    save = staticmethod(save_index_cache)

    def __getattr__(self, name):
        return getattr(np, name)


# megatron-core's dataset modules call `numpy.load` through their module-level `numpy` name.
for _module in (gpt_dataset, blended_dataset, masked_dataset):
    _module.numpy = _NumpyWithoutPickle("numpy")


class MegatronTokenizerView:
    """What GPTDatasetConfig/MegatronDataset read from a tokenizer.

    `unique_identifiers` enters megatron's cache hash; it holds only what is stable across
    machines (no absolute paths): the indices do not depend on the tokenizer file.
    """

    def __init__(self, tokenizer) -> None:
        self.vocab_size = tokenizer.vocab_size
        self.eod = tokenizer.eod
        self.eos = tokenizer.eod
        self.pad = -1  # megatron's "no pad": never equal to a real token
        self.unique_identifiers = OrderedDict(
            [("class", getattr(tokenizer, "name", type(tokenizer).__name__)),
             ("vocab_size", tokenizer.vocab_size), ("eod", tokenizer.eod)]
        )


_hashed_lengths: dict = {}


def _lengths_sha1(prefix: str, lengths) -> str:
    """sha1 of a dataset's document lengths (about 2 GB/s; 8 GB for two billion documents), once
    per process and version of the .idx (the train and valid splits read the same one)."""
    stat = os.stat(prefix + ".idx")
    key = (os.path.realpath(prefix), stat.st_size, stat.st_mtime_ns)
    if key not in _hashed_lengths:
        digest = hashlib.sha1(usedforsecurity=False)
        for start in range(0, len(lengths), 2**24):
            digest.update(np.ascontiguousarray(lengths[start:start + 2**24]))
        _hashed_lengths[key] = digest.hexdigest()
    return _hashed_lengths[key]


class TokenGPTDataset(GPTDataset):
    """GPTDataset returning raw token windows (no masks), and keyed on add_extra_token_to_sequence:
    megatron-core 0.16.1 leaves it out of the cache hash, so an AR run and a diffusion run
    sharing a cache directory would otherwise load each other's sample index."""

    @staticmethod
    def _key_config_attributes() -> List[str]:
        return GPTDataset._key_config_attributes() + ["add_extra_token_to_sequence"]

    def _build_document_sample_shuffle_indices(self):
        self._key_on_the_data()
        # megatron imports `helpers` inside this method: our sample-index builder stands in.
        with megatron_helpers_replaced():
            return super()._build_document_sample_shuffle_indices()

    def _key_on_the_data(self) -> None:
        """megatron-core's cache key names the dataset's path, not its data: a dataset written
        again at the same prefix would load the old indices (samples across documents that are
        no longer there). Its document count, .bin size and a hash of every document length
        enter the key (the same on every machine, also after a copy)."""
        lengths = self.dataset.sequence_lengths
        bin_bytes = os.path.getsize(self.dataset_path + ".bin")
        self.unique_identifiers["data"] = {"documents": len(lengths), "bin_bytes": bin_bytes,
                                           "lengths_sha1": _lengths_sha1(self.dataset_path, lengths)}
        self.unique_description = json.dumps(self.unique_identifiers, indent=4,
                                             default=lambda obj: obj.unique_identifiers)
        self.unique_description_hash = hashlib.md5(self.unique_description.encode("utf-8"),
                                                   usedforsecurity=False).hexdigest()

    def __getitem__(self, idx):
        tokens, _ = self._query_document_sample_shuffle_indices(idx)
        return {"tokens": tokens}


class SingleProcessSafeBlendedDataset(BlendedDataset):
    """BlendedDataset whose blending indices come from our builders (bit-identical to megatron's).

    Also: megatron-core 0.16.1's BlendedDataset calls torch.distributed.get_rank() on a cache
    miss even when torch.distributed is not initialised; a lone process is rank 0 for that call."""

    def _build_indices(self):
        with megatron_helpers_replaced():
            if torch.distributed.is_initialized():
                return super()._build_indices()
            get_rank = torch.distributed.get_rank
            torch.distributed.get_rank = lambda group=None: 0
            try:
                return super()._build_indices()
            finally:
                torch.distributed.get_rank = get_rank


class DatasetBuilder(BlendedMegatronDatasetBuilder):
    @staticmethod
    def build_generic_dataset(cls, is_built_on_rank, synchronize_ranks, *args):
        if cls is BlendedDataset:
            cls = SingleProcessSafeBlendedDataset
        return BlendedMegatronDatasetBuilder.build_generic_dataset(
            cls, is_built_on_rank, synchronize_ranks, *args)


class TokenSamples:
    """`len()` and `ds[i] -> np.ndarray[int64]` of length `sample_length` over a megatron
    mid-level (TokenGPTDataset) or top-level (BlendedDataset) dataset."""

    def __init__(self, dataset, sample_length: int) -> None:
        self.megatron_dataset = dataset
        self.sample_length = sample_length

    def __len__(self) -> int:
        return len(self.megatron_dataset)

    def __getitem__(self, idx: int) -> np.ndarray:
        return np.asarray(self.megatron_dataset[int(idx)]["tokens"], dtype=np.int64)


def check_prefix(prefix: str, flag: str, tokenizer, cache_dir: Optional[str]) -> int:
    """Validate the files and the token range against the tokenizer; return the token count."""
    if not (os.path.isfile(prefix + ".idx") or os.path.isfile(prefix + ".bin")):
        raise InputError(f"{flag}: no dataset at prefix {prefix!r} "
                         f"(expected {prefix}.bin and {prefix}.idx)")
    header = validate_indexed_dataset(prefix)
    check_made_with(prefix, tokenizer, flag)
    if (read_metadata(prefix) or {}).get("sft") is not None:  # read as text, its prompts would be noised and scored
        raise InputError(f"{flag}: {prefix} is an SFT dataset (tools/preprocess_sft_data.py); fine-tune on it "
                         f"with --sft")
    if header.num_tokens == 0:
        raise InputError(f"{flag}: {prefix}.bin holds no tokens, expected a non-empty dataset")
    limit, own_mask = data_id_rule(tokenizer)
    lo, hi, masks = scan_tokens(prefix, cache_dir, own_mask)
    if hi >= limit or lo < 0:
        raise InputError(
            f"{flag}: {prefix}.bin holds token ids in [{lo}, {hi}] but the tokenizer "
            f"({getattr(tokenizer, 'name', '?')}, vocab_size={tokenizer.vocab_size} incl. [MASK] id "
            f"{tokenizer.mask_id}) accepts ids 0..{limit - 1}: was it preprocessed with another tokenizer?"
        )
    if masks:
        raise InputError(
            f"{flag}: {prefix}.bin holds the tokenizer's [MASK] id {tokenizer.mask_id} {masks} times (text that "
            f"spells the mask token, encoded as it): a diffusion model cannot be trained to predict [MASK]; "
            f"preprocess it again with tools/preprocess_data.py, which rejects such documents "
            f"(tools/convert_dataset.py refuses such LITPKDS files)")
    return header.num_tokens


def _check_unweighted_members(blend, name: str, bounds, sample_tokens: int, flag: str) -> None:
    """megatron-core weights the datasets of an unweighted blend by their samples in one epoch; a
    part (`bounds` of each document list) shorter than one sample weighs 0 and fails its assertion."""
    prefixes, weights = blend
    if weights is not None or len(prefixes) < 2:
        return
    for prefix in prefixes:
        lengths = _document_lengths(prefix)
        beg, end = (int(round(b * len(lengths))) for b in bounds)
        tokens = int(lengths[beg:end].sum(dtype=np.int64))
        if tokens < sample_tokens:
            raise InputError(f"{flag}: the {name} part of {prefix} holds {tokens} tokens, less than one sample of "
                             f"{sample_tokens}, and an unweighted blend weighs each dataset by its samples; give "
                             f"weights ({flag} W1 PREFIX1 W2 PREFIX2 ...), another --split or a shorter --seq-length")


def _document_lengths(prefix: str) -> np.ndarray:
    """The token count of each document (sequence) of a validated dataset, read from its .idx."""
    n = validate_indexed_dataset(prefix).sequence_count
    return np.memmap(prefix + ".idx", dtype=np.int32, mode="r", offset=HEADER_SIZE, shape=(n,))


def _check_split_nonempty(prefix: str, split_matrix, sizes, flag: str) -> None:
    """megatron-core loops forever on a split without tokens; say so instead."""
    lengths = _document_lengths(prefix)
    n = len(lengths)
    for name, bounds, size in zip(("train", "valid", "test"), split_matrix, sizes):
        if size == 0 or (bounds is None and name == "train"):  # not read; no train split: none built (see below)
            continue
        beg, end = (int(round(b * n)) for b in bounds) if bounds is not None else (0, 0)  # None: weight 0
        if end <= beg or not lengths[beg:end].any():
            raise InputError(f"{flag}: the {name} split {bounds or '(weight 0 in --split)'} of {prefix} ({n} "
                             f"documents) is empty; change --split or give --valid-data-path")


def _check_all_prefixes(blends, tokenizer, cache_dir, cache_errors) -> None:
    """Scan token ranges on rank 0 first (the scan reads whole .bin files and is cached), then
    the other ranks, which find the cache. Rank 0's error is every rank's (each prints it), not
    the other ranks' tracebacks at a barrier rank 0 never reached."""
    def check_all():
        with cache_errors():
            for flag, blend in blends:
                for prefix in blend[0] if blend else []:
                    check_prefix(prefix, flag, tokenizer, cache_dir)

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    error = None
    if rank == 0:
        try:
            check_all()
        except InputError as err:
            error = err
    message = platform.from_rank(None if error is None else str(error), 0)
    if message is not None:
        raise error or InputError(message)  # rank 0 its own (a DatasetFormatError stays one)
    if rank != 0:
        check_all()


@contextmanager
def _cache_write_errors(cache_path: str, given: bool):
    """An OSError writing under the index cache (megatron-core re-raises it as a bare Exception)
    as one InputError naming --data-cache-path; errors elsewhere pass unchanged."""
    try:
        yield
    except Exception as err:
        cause = err if isinstance(err, OSError) else err.__cause__
        filename = getattr(cause, "filename", None)
        if not isinstance(cause, OSError) or not filename or os.path.commonpath(
                [os.path.abspath(filename), os.path.abspath(cache_path)]) != os.path.abspath(cache_path):
            raise
        where = cache_path if given else f"{cache_path} (the default: beside the first --data-path prefix)"
        raise InputError(f"--data-cache-path {where}: {cause.strerror} ({filename}); the run writes the "
                         f"datasets' index files there: give a writable --data-cache-path") from None


def build_datasets(
    data_path: Sequence[str],
    split: Optional[str],
    valid_data_path: Optional[Sequence[str]],
    seq_length: int,
    add_extra_token: bool,
    seed: int,
    num_train_samples: Optional[int],
    num_valid_samples: Optional[int],
    cache_path: Optional[str],
    tokenizer,
) -> Tuple[TokenSamples, Optional[TokenSamples]]:
    """Build (train, valid).

    `data_path` is in `--data-path` form. Without `valid_data_path`, `split` ('969,30,1')
    carves train and valid out of it with Megatron's bounds (the test part is never built);
    with it, train is all of `data_path` and valid all of `valid_data_path`. A sample count of
    None means one full epoch; `num_valid_samples=0` gives valid None, as `--split` giving the
    train part weight 0 gives train None (an evaluation reads only the valid split). Lengths are >= the
    requested counts (megatron builds whole epochs for a single prefix and for a weighted blend; an
    unweighted blend of several prefixes that holds fewer is an InputError).
    """
    train_blend = parse_data_path(data_path, "--data-path")
    valid_blend = parse_data_path(valid_data_path, "--valid-data-path") if valid_data_path else None
    cache_given = cache_path is not None
    if not cache_given:
        cache_path = os.path.join(os.path.dirname(os.path.abspath(train_blend[0][0])), "cache")
    cache_errors = partial(_cache_write_errors, cache_path, cache_given)
    _check_all_prefixes((("--data-path", train_blend), ("--valid-data-path", valid_blend)),
                        tokenizer, os.path.join(cache_path, "token_ranges"), cache_errors)
    for name, blend, size in (("train", train_blend, num_train_samples),
                              ("valid", valid_blend or train_blend, num_valid_samples)):
        if blend[1] is not None and size is None:
            raise InputError(f"a weighted {name} blend needs a sample count (megatron cannot size it)")

    sizes = [num_train_samples, num_valid_samples, 0]
    common = dict(
        random_seed=seed,
        sequence_length=seq_length,
        path_to_cache=cache_path,
        tokenizer=MegatronTokenizerView(tokenizer),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        add_extra_token_to_sequence=add_extra_token,
        drop_last_partial_validation_sequence=True,  # every sample full length, no padding
        mmap_bin_files=True,
    )
    if valid_blend is None:
        if not split:
            raise InputError("--split is required when --valid-data-path is not given")
        config = GPTDatasetConfig(blend=train_blend, split=split, **common)
        # Drop the test part (and an unused valid part) without moving Megatron's split bounds.
        config.split_matrix = [config.split_matrix[0],
                               config.split_matrix[1] if num_valid_samples != 0 else None, None]
        for prefix in train_blend[0]:
            _check_split_nonempty(prefix, config.split_matrix, sizes, "--data-path")
    else:
        config = GPTDatasetConfig(
            blend_per_split=[train_blend, valid_blend if num_valid_samples != 0 else None, None],
            **common,
        )

    parts = (config.split_matrix if valid_blend is None else [(0.0, 1.0), (0.0, 1.0), None])
    for name, flag, blend, bounds, size in (("train", "--data-path", train_blend, parts[0], num_train_samples),
                                            ("valid", "--valid-data-path" if valid_blend else "--data-path",
                                             valid_blend or train_blend, parts[1], num_valid_samples)):
        if size != 0 and bounds is not None:
            _check_unweighted_members(blend, name, bounds, seq_length + int(add_extra_token), flag)
    with cache_errors():  # one rank's failure here still leaves the others at megatron-core's barrier
        train, valid, _ = DatasetBuilder(TokenGPTDataset, sizes, lambda: True, config).build()
    for name, flag, blend, dataset, wanted in (("train", "--data-path", train_blend, train, num_train_samples),
                                               ("valid", "--valid-data-path" if valid_blend else "--data-path",
                                                valid_blend or train_blend, valid, num_valid_samples)):
        # megatron-core sizes an unweighted blend of several prefixes to one epoch of each
        if dataset is not None and wanted and len(dataset) < wanted:
            raise InputError(f"{flag}: the unweighted blend of {len(blend[0])} datasets holds {len(dataset)} {name} "
                             f"samples (one epoch of each), fewer than the {wanted} the run reads; give weights "
                             f"({flag} W1 PREFIX1 W2 PREFIX2 ...), which megatron repeats over epochs")
    sample_length = seq_length + int(add_extra_token)
    return (TokenSamples(train, sample_length) if train is not None else None,
            TokenSamples(valid, sample_length) if valid is not None else None)
