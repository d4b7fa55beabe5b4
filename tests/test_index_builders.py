"""Sample and blending index builders: C++ == numpy == megatron-core's helpers_cpp, the hook into
megatron's datasets, and tools/build_indexes.py producing exactly the caches training loads."""

import os

import numpy as np
import pytest
from conftest import REPO, launch_env, run_python
from megatron.core.datasets import helpers_cpp  # shipped prebuilt with megatron-core

from megatron_dllm.data import index_builders as ib


def test_the_extension_is_built():
    """setup.py always builds csrc/ (C++ needs no GPU): a missing extension is a failed build."""
    assert ib.HAVE_CPP, "megatron_dllm._index_builders did not build; see the pip install log"


def megatron_sample_idx(sizes, doc_idx, seq, epochs, tpe, drop_last, extra):
    """megatron-core's C++ directly (its Python wrapper asserts offsets >= 0, which the raw
    function violates only for an empty last document with drop_last=False)."""
    fn = helpers_cpp.build_sample_idx_int32 if ib.sample_idx_dtype(sizes, doc_idx) == np.int32 \
        else helpers_cpp.build_sample_idx_int64
    return fn(sizes, doc_idx, seq, epochs, tpe, drop_last, int(extra))


def ours_all(sizes, doc_idx, seq, epochs, tpe, drop_last, extra):
    """(label, output) for numpy and for C++ at several forced thread counts."""
    outs = [("numpy", ib.build_sample_idx_numpy(sizes, doc_idx, seq, epochs, tpe, drop_last, extra))]
    if ib.HAVE_CPP:  # test_the_extension_is_built fails when it is missing
        fn = ib._cpp.build_sample_idx_int32 if ib.sample_idx_dtype(sizes, doc_idx) == np.int32 \
            else ib._cpp.build_sample_idx_int64
        for threads in (1, 2, 3, 8):
            outs.append((f"cpp/{threads}", fn(sizes, doc_idx, seq, epochs, tpe, drop_last, int(extra),
                                              threads)))
        for threads, block in ((1, 1), (2, 7)):  # several document blocks
            outs.append((f"cpp/{threads}/block{block}", fn(sizes, doc_idx, seq, epochs, tpe, drop_last,
                                                            int(extra), threads, block)))
        outs.append(("public", ib.build_sample_idx(sizes, doc_idx, seq, epochs, tpe, drop_last, extra)))
    return outs


def check_sample_idx(sizes, doc_idx, seq, epochs, drop_last, extra, tpe=None):
    sizes = np.asarray(sizes, dtype=np.int32)
    doc_idx = np.asarray(doc_idx, dtype=np.int32)
    tpe = int(sizes[doc_idx[: len(doc_idx) // epochs]].sum()) if tpe is None else tpe
    ref = megatron_sample_idx(sizes, doc_idx, seq, epochs, tpe, drop_last, extra)
    for label, out in ours_all(sizes, doc_idx, seq, epochs, tpe, drop_last, extra):
        assert out.dtype == ref.dtype and out.shape == ref.shape, label
        np.testing.assert_array_equal(out, ref, err_msg=f"{label}: sizes={sizes.tolist()[:50]} "
                                      f"seq={seq} epochs={epochs} drop_last={drop_last} extra={extra}")


def epoch_doc_idx(rng, num_docs, epochs):
    return np.concatenate([rng.permutation(num_docs) for _ in range(epochs)]).astype(np.int32)


# ---------------------------------------------------------------- sample index


@pytest.mark.parametrize("extra", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_sample_idx_random(extra, drop_last):
    rng = np.random.default_rng(int(extra) * 2 + int(drop_last))
    checked = 0
    for trial in range(250):
        num_docs = int(rng.integers(1, 60))
        kind = trial % 5
        if kind == 0:
            sizes = rng.integers(1, 50, num_docs)  # short documents, many per sample
        elif kind == 1:
            sizes = rng.integers(0, 5, num_docs)  # empty documents included
            sizes[rng.integers(num_docs)] = 7
        elif kind == 2:
            sizes = rng.integers(200, 3000, num_docs)  # documents longer than the sequence
        elif kind == 3:
            sizes = np.maximum(1, rng.lognormal(3, 1.2, num_docs)).astype(np.int64)
        else:
            sizes = np.full(num_docs, int(rng.integers(2, 40)))  # equal lengths: exact fits
        seq = int(rng.integers(2, 70))
        epochs = int(rng.integers(1, 5))
        doc_idx = epoch_doc_idx(rng, num_docs, epochs)
        tpe = int(sizes.sum())
        if tpe <= 1 or (epochs * tpe - int(extra)) // seq < 1:
            continue
        check_sample_idx(sizes, doc_idx, seq, epochs, drop_last, extra)
        checked += 1
    assert checked > 150


@pytest.mark.parametrize("extra", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_sample_idx_edge_cases(extra, drop_last):
    e = int(extra)
    cases = [
        ([1000], [0], 7, 1),  # one document
        ([1000], [0, 0, 0], 64, 3),  # one document, several epochs
        ([9, 9, 9, 9], [2, 0, 3, 1], 9, 1),  # every document exactly one sequence
        ([10, 10, 10, 10], [0, 1, 2, 3], 10 - e if 10 - e > 1 else 10, 1),  # exact fit with the extra token
        ([4, 4], [0, 1], 2, 1),  # seq_length 2
        ([5000, 3, 0, 1, 4097], [3, 2, 0, 4, 1], 128, 1),  # long docs and empty docs
        ([0, 0, 50, 0], [0, 1, 2, 3], 8, 1),  # leading and trailing empty documents
        ([2, 3, 5, 7, 11], [4, 3, 2, 1, 0, 0, 1, 2, 3, 4], 4, 2),
    ]
    for sizes, doc_idx, seq, epochs in cases:
        check_sample_idx(sizes, doc_idx, seq, epochs, drop_last, extra)


@pytest.mark.slow
def test_sample_idx_large_multithreaded():
    """Chunk boundaries fall everywhere on a realistic length distribution (and a sorted one)."""
    rng = np.random.default_rng(7)
    sizes = np.maximum(1, rng.lognormal(np.log(1000) - 0.5, 1.0, 200_000)).astype(np.int32)
    for epochs, extra in ((1, True), (2, False)):
        doc_idx = epoch_doc_idx(rng, len(sizes), epochs)
        check_sample_idx(sizes, doc_idx, 2048, epochs, True, extra)
    check_sample_idx(np.sort(sizes), np.arange(len(sizes), dtype=np.int32), 1024, 1, False, True)
    doc_idx = epoch_doc_idx(rng, len(sizes), 1)
    ref = megatron_sample_idx(sizes, doc_idx, 2048, 1, int(sizes.sum()), True, True)
    for block in (4096, 65_537):
        out = ib._cpp.build_sample_idx_int32(sizes, doc_idx, 2048, 1, int(sizes.sum()), True, 1, 2, block)
        np.testing.assert_array_equal(out, ref)


def test_sample_idx_int64_variant():
    rng = np.random.default_rng(3)
    sizes = rng.integers(1, 300, 500).astype(np.int32)
    doc_idx = epoch_doc_idx(rng, 500, 2)
    tpe = int(sizes.sum())
    for extra in (0, 1):
        ref = helpers_cpp.build_sample_idx_int64(sizes, doc_idx, 37, 2, tpe, True, extra)
        for threads in (1, 4):
            out = ib._cpp.build_sample_idx_int64(sizes, doc_idx, 37, 2, tpe, True, extra, threads)
            assert out.dtype == np.int64
            np.testing.assert_array_equal(out, ref)


def test_sample_count_float32_rounding():
    # megatron's ceil branch rounds through float32: 2**24 + 1 tokens -> 2**24
    assert ib.num_samples(2, 1, 2**24 + 2, False, True) == int(np.ceil(np.float32(2**24 + 1) / 2))
    assert ib.num_samples(2, 1, 2**24 + 2, True, True) == (2**24 + 1) // 2


def test_sample_idx_rejects_bad_document_index():
    with pytest.raises(IndexError):
        ib._cpp.build_sample_idx_int32(np.array([5, 5], np.int32), np.array([0, 2], np.int32), 3, 1, 10,
                                       True, 1, 1)


# ---------------------------------------------------------------- blending indices


def megatron_blend(weights, size):
    a = np.zeros(size, np.int16)
    b = np.zeros(size, np.int64)
    helpers_cpp.build_blending_indices(a, b, list(weights), len(weights), size, False)
    return a, b


def test_blending_indices_random_weights():
    rng = np.random.default_rng(11)
    for trial in range(120):
        n = int(rng.integers(1, 16))
        size = int(rng.integers(0, 4000))
        w = rng.random(n) + (1.0 if trial % 3 == 0 else 1e-3)
        if trial % 7 == 0:
            w = np.ones(n)  # ties: the lowest index wins
        w = list(w / w.sum()) if trial % 2 == 0 else list(w)  # normalized or not
        ref = megatron_blend(w, size)
        runs = [("numpy", "numpy", None)] if size <= 1500 else []
        if ib.HAVE_CPP:
            runs += [(f"cpp/{t}", "cpp", t) for t in (1, 2, 3, 8)]
        for label, backend, threads in runs:
            a = np.zeros(size, np.int16)
            b = np.zeros(size, np.int64)
            if threads is None:
                ib.build_blending_indices(a, b, w, n, size, False, backend=backend)
            else:
                ib._cpp.build_blending_indices(a, b, np.asarray(w), n, size, False, threads)
            np.testing.assert_array_equal(a, ref[0], err_msg=label)
            np.testing.assert_array_equal(b, ref[1], err_msg=label)


@pytest.mark.parametrize("n", [2, 3, 40])
def test_blending_indices_large_parallel(n):
    rng = np.random.default_rng(n)
    w = rng.dirichlet(np.ones(n))
    size = 1_500_000
    ref = megatron_blend(w, size)
    for threads in (2, 5):
        a, b = np.zeros(size, np.int16), np.zeros(size, np.int64)
        ib._cpp.build_blending_indices(a, b, w, n, size, False, threads)
        np.testing.assert_array_equal(a, ref[0])
        np.testing.assert_array_equal(b, ref[1])


def test_blending_repair_path_is_exact():
    """Speculative chunks that start from a wrong state are re-run until they rejoin: force wrong
    starts (no warm-up, so the guess is the rounded ideal counts) and check the output is exact."""
    rng = np.random.default_rng(2)
    repaired = 0
    for n in (2, 3, 7, 30):
        w = rng.dirichlet(np.ones(n) * 0.3)
        size = 200_000
        ref = megatron_blend(w, size)
        for warmup in (0, 1, 50):
            a, b = np.zeros(size, np.int16), np.zeros(size, np.int64)
            ib._cpp.build_blending_indices(a, b, w, n, size, False, 7, warmup)
            repaired += ib._cpp.last_blend_repair_steps()
            np.testing.assert_array_equal(a, ref[0])
            np.testing.assert_array_equal(b, ref[1])
    assert repaired > 0  # the repair path did run


def test_exhaustive_blending_indices():
    rng = np.random.default_rng(5)
    for _ in range(30):
        n = int(rng.integers(1, 8))
        sizes = rng.integers(1, 300, n).astype(np.int64)
        total = int(sizes.sum())
        ra, rb = np.zeros(total, np.int16), np.zeros(total, np.int64)
        helpers_cpp.build_exhaustive_blending_indices(ra, rb, sizes, n)
        for backend in ("numpy", "cpp") if ib.HAVE_CPP else ("numpy",):
            a, b = np.zeros(total, np.int16), np.zeros(total, np.int64)
            ib.build_exhaustive_blending_indices(a, b, sizes, n, backend=backend)
            np.testing.assert_array_equal(a, ra)
            np.testing.assert_array_equal(b, rb)


def test_auto_without_the_extension_uses_megatrons_helpers_not_numpy(monkeypatch):
    """numpy is ~30x slower than megatron-core's compiled helpers (benchmarks/RESULTS.md)."""
    rng = np.random.default_rng(3)
    sizes = rng.integers(1, 3000, 500).astype(np.int32)
    doc_idx = rng.permutation(np.tile(np.arange(500, dtype=np.int32), 2))
    weights, size = list(rng.dirichlet(np.ones(4))), 5000
    counts = rng.integers(1, 300, 3).astype(np.int64)

    def built():
        a, b = np.zeros(size, np.int16), np.zeros(size, np.int64)
        ib.build_blending_indices(a, b, weights, len(weights), size)
        c, d = np.zeros(int(counts.sum()), np.int16), np.zeros(int(counts.sum()), np.int64)
        ib.build_exhaustive_blending_indices(c, d, counts, len(counts))
        return ib.build_sample_idx(sizes, doc_idx, 2048, 2, int(sizes.sum()), True, True), a, b, c, d

    monkeypatch.delenv("MEGATRON_DLLM_INDEX_BACKEND", raising=False)
    with_extension = built()
    monkeypatch.setattr(ib, "HAVE_CPP", False)
    monkeypatch.setattr(ib, "_cpp", None)
    for name in ("build_sample_idx_numpy", "build_blending_indices_numpy", "build_exhaustive_blending_indices_numpy"):
        monkeypatch.setattr(ib, name, lambda *a, **k: pytest.fail("auto fell back to numpy"))
    assert ib._backend(None) == "megatron"
    for ours, theirs in zip(with_extension, built()):
        np.testing.assert_array_equal(ours, theirs)
    assert ib.backend_in_words() == "megatron-core's helpers_cpp (extension not built)"


@pytest.mark.parametrize("chosen, words", [("", "C++"), ("megatron", "megatron-core's helpers_cpp"),
                                           ("numpy", "numpy (reference)")])
def test_the_logs_name_the_builders_in_use(monkeypatch, chosen, words):
    """build_indexes' log line names MEGATRON_DLLM_INDEX_BACKEND's choice, not whether C++ is built."""
    monkeypatch.setenv("MEGATRON_DLLM_INDEX_BACKEND", chosen or "auto")
    assert ib.backend_in_words() == words


def test_hook_swaps_and_restores_megatron_helpers():
    from megatron.core.datasets import helpers

    original = helpers.build_sample_idx, helpers.build_blending_indices
    with ib.megatron_helpers_replaced():
        with ib.megatron_helpers_replaced():
            assert helpers.build_sample_idx is ib.build_sample_idx
        assert helpers.build_blending_indices is ib.build_blending_indices
    assert (helpers.build_sample_idx, helpers.build_blending_indices) == original


# ---------------------------------------------------------------- build_indexes -> cache hit


def _write_corpus(tmp_path):
    """Two small prefixes and a tiny word-level HuggingFace tokenizer (ids 0..63, EOS 0)."""
    import tokenizers  # a declared dependency

    from megatron_dllm.data.prep.dataset_writer import IndexedDatasetWriter

    vocab = {"</s>": 0, **{f"w{i}": i for i in range(1, 64)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w1"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    rng = np.random.default_rng(0)
    prefixes = []
    for name, num_docs in (("web", 400), ("math", 250)):
        prefix = str(tmp_path / f"{name}_text_document")
        with IndexedDatasetWriter(prefix, np.uint16) as w:
            for _ in range(num_docs):
                doc = rng.integers(1, 64, int(rng.integers(5, 300))).tolist() + [0]
                w.add_document(doc)
        prefixes.append(prefix)
    return prefixes, str(tmp_path / "tokenizer.json")


def _snapshot(cache):
    return {name: (os.stat(os.path.join(cache, name)).st_mtime_ns,
                   open(os.path.join(cache, name), "rb").read())
            for name in sorted(os.listdir(cache)) if name.endswith((".npy", ".txt"))}


@pytest.mark.slow
def test_build_indexes_then_training_hits_the_cache(tmp_path):
    prefixes, tokenizer = _write_corpus(tmp_path)
    cache = str(tmp_path / "cache")
    flags = ["--data-path", "0.7", prefixes[0], "0.3", prefixes[1], "--split", "949,50,1",
             "--seq-length", "32", "--seed", "7", "--train-samples", "1000", "--global-batch-size", "8",
             "--eval-interval", "5", "--eval-iters", "2", "--tokenizer-type", "HuggingFaceTokenizer",
             "--tokenizer-model", tokenizer, "--data-cache-path", cache]
    for family in ("ar", "mdlm"):  # AR adds the extra token: its own caches
        proc = run_python([os.path.join(REPO, "tools", "build_indexes.py"), "--family", family, *flags], os.getcwd(),
                          launch_env(1), 120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "build_indexes: done in" in proc.stdout and "Build and save" in proc.stdout
    built = _snapshot(cache)
    assert sum(n.endswith("-sample_index.npy") for n in built) == 8  # 2 families x 2 prefixes x 2 splits
    assert sum(n.endswith("-dataset_index.npy") for n in built) == 4  # 2 families x 2 splits

    # What training does: resolve the same flags; nothing is rebuilt or rewritten.
    from megatron_dllm.config import parse_args
    from megatron_dllm.training.inputs import prepare_inputs

    for family in ("ar", "mdlm"):
        _, inputs = prepare_inputs(parse_args(["--family", family, *flags]))
        assert len(inputs.train_dataset) == 1000 and inputs.train_dataset[0].shape == (32 + (family == "ar"),)
    assert _snapshot(cache) == built

    # The files are the ones megatron-core's own helpers write (interchangeable caches).
    cache_megatron = str(tmp_path / "cache_megatron")
    os.environ["MEGATRON_DLLM_INDEX_BACKEND"] = "megatron"
    try:
        for family in ("ar", "mdlm"):
            argv = ["--family", family, *flags[:-1], cache_megatron]
            prepare_inputs(parse_args(argv))
    finally:
        del os.environ["MEGATRON_DLLM_INDEX_BACKEND"]
    theirs = _snapshot(cache_megatron)
    assert sorted(theirs) == sorted(built)
    for name in built:
        assert built[name][1] == theirs[name][1], name


@pytest.mark.parametrize("sizes, doc_idx, seq, epochs", [
    ([1], [0], 8, 1),  # a one-token dataset or split (an empty text with --append-eod)
    ([5, 3], [0, 1, 0, 1], 1, 2),  # --seq-length 1
])
def test_sample_idx_of_one_token_samples_or_splits_is_megatrons(sizes, doc_idx, seq, epochs):
    """The builders here need samples and epochs of 2 tokens or more; megatron-core's handles
    fewer, and the public builder hands such cases to it."""
    sizes, doc_idx = np.asarray(sizes, dtype=np.int32), np.asarray(doc_idx, dtype=np.int32)
    tpe = int(sizes[doc_idx[: len(doc_idx) // epochs]].sum())
    ref = megatron_sample_idx(sizes, doc_idx, seq, epochs, tpe, True, True)
    np.testing.assert_array_equal(ib.build_sample_idx(sizes, doc_idx, seq, epochs, tpe), ref)
