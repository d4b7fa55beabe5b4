#!/usr/bin/env python
"""Precompute the dataset index caches a training run needs, so that training starts without
building them (rank 0 of a large run would otherwise spend minutes on it while the others wait).

Takes the training command's own flags (any `pretrain_dllm.py` flag is accepted; the ones that
matter are the data ones):

    python tools/build_indexes.py --family mdlm \\
        --data-path 0.7 /data/web_text_document 0.3 /data/math_text_document --split 969,30,1 \\
        --seq-length 2048 --seed 1234 --train-iters 1001358 --global-batch-size 1024 \\
        --eval-interval 1000 --eval-iters 10 \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model /data/tokenizer.json \\
        --data-cache-path /data/index-cache

It resolves the run exactly as `pretrain_dllm.py` does (defaults, sample counts, the family's
extra token: AR samples are seq_length + 1 tokens) and builds the datasets once, in this process.
That writes megatron-core's cache files under `--data-cache-path` (default
`<directory of the first prefix>/cache`): per dataset and split
`{hash}-TokenGPTDataset-{split}-{description.txt,document_index,sample_index,shuffle_index}.npy`,
per blend `{hash}-SingleProcessSafeBlendedDataset-{split}-{description.txt,dataset_index,dataset_sample_index}.npy`,
plus the token-range scan of each prefix. The cache directory is locked while building
(`.dllm-writer.lock`): a second builder stops with one line naming the first. Training with the
same flags then loads them and builds nothing. Existing cache files are loaded
without unpickling: one that holds Python objects is refused (`error: index cache <file>: ...`,
exit code 2). The sample and blending indices come from `megatron_dllm.data.index_builders`
(C++, `MEGATRON_DLLM_INDEX_THREADS` threads, default all cores).
"""

import logging
import os
import sys
import time

from megatron_dllm import platform  # noqa: F401  (first: on CPU it quiets megatron-core's fallback warnings)
from megatron_dllm.cli import reports_bad_input


def _cache_files(path):
    if not path or not os.path.isdir(path):
        return {}
    return {name: os.stat(os.path.join(path, name)).st_mtime_ns
            for name in os.listdir(path) if name.endswith((".npy", ".txt"))}


def build(argv=None) -> dict:
    from megatron_dllm.config import parse_args
    from megatron_dllm.data import index_builders
    from megatron_dllm.data.datasets import parse_data_path
    from megatron_dllm.data.prep.output import check_writable
    from megatron_dllm.output_lock import OutputLock, lock_path_for_dir
    from megatron_dllm.training.inputs import prepare_inputs

    config = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    logging.getLogger("megatron.core.datasets").setLevel(logging.INFO)

    def cache_of(data_path):
        if config.data.data_cache_path or not data_path:
            return config.data.data_cache_path
        return os.path.join(os.path.dirname(os.path.abspath(parse_data_path(data_path)[0][0])), "cache")

    cache = cache_of(config.data.data_path or config.data.train_data_path)
    before = _cache_files(cache)
    lock = None
    if cache:  # two builders never write one cache directory at once
        check_writable(cache, f"--data-cache-path {cache}")
        lock = OutputLock(lock_path_for_dir(cache), f"--data-cache-path {cache}").acquire()
    try:
        t0 = time.perf_counter()
        config, inputs = prepare_inputs(config)
        elapsed = time.perf_counter() - t0
    finally:
        if lock is not None:
            lock.release()
    cache = cache or cache_of(config.data.data_path)  # the embedded demo: its prefixes are known only now
    after = _cache_files(cache)
    new = sorted(n for n, m in after.items() if before.get(n) != m)

    training = config.training
    print(f"build_indexes: family {config.model.family}, seq_length {config.model.seq_length}, seed {training.seed}, "
          f"{training.train_iters} iterations x {training.global_batch_size} = "
          f"{training.train_iters * training.global_batch_size} training samples; index builders: "
          f"{index_builders.backend_in_words()}")
    print(f"build_indexes: train dataset {len(inputs.train_dataset)} samples"
          + (f", valid dataset {len(inputs.valid_dataset)} samples" if inputs.valid_dataset is not None else ""))
    print(f"build_indexes: cache {cache}: {len(new)} files written, "
          f"{len(after) - len(new)} already present")
    for name in new:
        print(f"  {name}")
    print(f"build_indexes: done in {elapsed:.2f} s")
    return {"cache": cache, "written": new, "seconds": elapsed}


@reports_bad_input()
def main(argv=None) -> int:
    """`build` with bad input (a flag, a dataset, a refused index cache) as one `error:` line, exit 2."""
    build(argv)
    return 0
