"""The dataset writers (preprocess_data, merge_datasets, convert_dataset, preprocess_sft_data,
build_indexes): one writer at a time, staging names of their own with a pair published whole,
nothing existing replaced without --overwrite, the tokenizer options the data was made with
enforced, and bad input (non-UTF-8 SFT lines, a read-only output directory) as one error line."""
import contextlib
import glob
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import REPO, launch_env, run_python, tekken_vocab, tmpfs

from megatron_dllm.data.indexed_dataset import meta_path, open_indexed_dataset, read_metadata, validate_indexed_dataset
from megatron_dllm.data.prep.dataset_writer import IndexedDatasetWriter
from megatron_dllm.data.prep.preprocess import preprocess

SP = "SentencePieceTokenizer"
QUIET = dict(log=lambda m: None)

HOLDER = """
import sys
from megatron_dllm.output_lock import OutputLock
lock = OutputLock(sys.argv[1], "holder").acquire()
print("held", flush=True)
sys.stdin.read()
lock.release()
"""


def _jsonl(records) -> bytes:
    return b"".join(json.dumps({"text": r}).encode() + b"\n" for r in records)


def _env(**extra):
    env = {**launch_env(1), **extra}
    env.pop("DLLM_LOCK_MODE", None)
    return env


def _tool(name, *args, env=None):
    return run_python([os.path.join(REPO, "tools", name), *map(str, args)], REPO, env or _env(), 300)


def _one_error_line(r, *needles):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (r.returncode, r.stderr[-3000:])
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _md5s(directory):
    out = {}
    for path in sorted(glob.glob(os.path.join(directory, "**"), recursive=True)):
        if os.path.isfile(path):
            out[path] = hashlib.md5(open(path, "rb").read()).hexdigest()
    return out


@contextlib.contextmanager
def _held(lock_path):
    """The lock held by another process, as a running writer holds it."""
    p = subprocess.Popen([sys.executable, "-c", HOLDER, lock_path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env=_env())
    try:
        assert p.stdout.readline().strip() == "held"
        yield p.pid
    finally:
        p.communicate("")


def _preprocess_args(src, prefix, sp_model, *extra):
    return ["--input", src, "--output-prefix", prefix, "--tokenizer-type", SP, "--tokenizer-model", sp_model,
            "--no-progress", *extra]


def _litpkds_input(directory, tokens):
    from test_litpkds import write_litpkds

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "0_f.bin")
    write_litpkds(path, tokens, 4)
    return path


def _sft_input(path, n=5):
    path.write_text("".join(json.dumps({"prompt": f"Question {i}?\n", "response": f"Answer {i}"}) + "\n"
                            for i in range(n)))
    return str(path)


# ---------------------------------------------------------------- one writer at a time


def test_preprocess_second_writer_exits_2_while_the_first_runs(tmp_path, sp_model, paragraphs):
    """The first writer is stopped (SIGSTOP) mid-run, holding its lock; a second one on the same
    prefix stops at once naming it, and the first then finishes with the same output as an
    undisturbed run."""
    (tmp_path / "in.jsonl").write_bytes(_jsonl(paragraphs * 4))
    preprocess([str(tmp_path / "in.jsonl")], str(tmp_path / "ref" / "c"), SP, sp_model, **QUIET)
    out = str(tmp_path / "out" / "c")
    lock = out + "_text_document.lock"
    first = subprocess.Popen([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"),
                              *_preprocess_args(tmp_path / "in.jsonl", out, sp_model)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=_env())
    try:
        # held: the lock taken and its record written (the file exists a moment before both)
        while not (os.path.exists(lock) and os.stat(lock).st_size > 0) and first.poll() is None:
            time.sleep(0.002)
        os.kill(first.pid, signal.SIGSTOP)
        assert first.poll() is None and os.path.exists(lock), "the first writer finished before it was held"
        r = _tool("preprocess_data.py", *_preprocess_args(tmp_path / "in.jsonl", out, sp_model, "--overwrite"))
        line = _one_error_line(r, f"--output-prefix {out} ({out}_text_document): another writer is using it: "
                                  f"pid {first.pid} on host ")
        assert "started 20" in line
        os.kill(first.pid, signal.SIGCONT)
        _, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err[-2000:]
    for ext in (".bin", ".idx", ".meta.json"):
        assert open(f"{out}_text_document{ext}", "rb").read() == \
            open(str(tmp_path / "ref" / "c_text_document") + ext, "rb").read()
    assert not glob.glob(out + "*.lock") and not glob.glob(out + "*.tmp-*")


def test_each_shard_is_locked_on_its_own(tmp_path, sp_model, paragraphs):
    src = tmp_path / "in.jsonl"
    src.write_bytes(_jsonl(paragraphs[:100]))
    out = str(tmp_path / "c")
    with _held(f"{out}_shard00000of00002_text_document.lock") as pid:
        r = _tool("preprocess_data.py", *_preprocess_args(src, out, sp_model, "--num-shards", 2, "--shard-index", 0))
        _one_error_line(r, f"--output-prefix {out} ({out}_shard00000of00002_text_document): another writer "
                           f"is using it: pid {pid}")
        r = _tool("preprocess_data.py", *_preprocess_args(src, out, sp_model, "--num-shards", 2, "--shard-index", 1))
        assert r.returncode == 0, r.stderr[-2000:]
    assert not os.path.exists(f"{out}_shard00000of00002.done.json")
    assert os.path.exists(f"{out}_shard00001of00002.done.json")


def _made(tmp_path, sp_model, paragraphs):
    src = tmp_path / "in.jsonl"
    src.write_bytes(_jsonl(paragraphs[:100]))
    return preprocess([str(src)], str(tmp_path / "made" / "p"), SP, sp_model, **QUIET).output_prefixes["text"]


@pytest.mark.parametrize("tool", ["merge", "convert", "sft"])
def test_other_writers_exit_2_while_the_output_is_locked(tmp_path, sp_model, paragraphs, tool):
    out = str(tmp_path / "out" / "o")
    if tool == "merge":
        made = _made(tmp_path, sp_model, paragraphs)
        argv = ("merge_datasets.py", "--input", made, "--output-prefix", out)
    elif tool == "convert":
        argv = ("convert_dataset.py", "--from", "litpkds", _litpkds_input(str(tmp_path), [5, 6, 2, 7]),
                "--eos-id", 2, "--output-prefix", out)
    else:
        argv = ("preprocess_sft_data.py", "--input", _sft_input(tmp_path / "s.jsonl"), "--output-prefix", out,
                "--seq-length", 32, "--tokenizer-type", SP, "--tokenizer-model", sp_model)
    assert _tool(*argv).returncode == 0  # an earlier output, which the refused writer must not touch
    before = _md5s(os.path.dirname(out))
    with _held(out + ".lock") as pid:
        r = _tool(*argv, "--overwrite")
        _one_error_line(r, f"--output-prefix {out}", f"another writer is using it: pid {pid} on host ")
        assert _md5s(os.path.dirname(out)) == {**before, out + ".lock": _md5s(os.path.dirname(out))[out + ".lock"]}
    assert _md5s(os.path.dirname(out)) == before


def _build_indexes_args(prefix, sp_model, cache):
    return ["--family", "mdlm", "--preset", "cpu-tiny", "--data-path", prefix, "--split", "90,10,0",
            "--seq-length", 32, "--train-iters", 2, "--global-batch-size", 2, "--micro-batch-size", 2,
            "--eval-interval", 100, "--eval-iters", 1, "--tokenizer-type", SP, "--tokenizer-model", sp_model,
            "--data-cache-path", cache]


def test_build_indexes_second_builder_exits_2(tmp_path, sp_model, paragraphs):
    prefix = _made(tmp_path, sp_model, paragraphs)
    cache = str(tmp_path / "cache")
    os.makedirs(cache)
    with _held(os.path.join(cache, ".dllm-writer.lock")) as pid:
        r = _tool("build_indexes.py", *_build_indexes_args(prefix, sp_model, cache))
        _one_error_line(r, f"--data-cache-path {cache}: another writer is using it: pid {pid} on host ")
        assert sorted(os.listdir(cache)) == [".dllm-writer.lock"]  # nothing built meanwhile
    r = _tool("build_indexes.py", *_build_indexes_args(prefix, sp_model, cache))
    assert r.returncode == 0 and "files written" in r.stdout, r.stderr[-2000:]
    assert not os.path.exists(os.path.join(cache, ".dllm-writer.lock"))


# ---------------------------------------------------------------- staging names, a pair published whole


def _writer(prefix, docs):
    w = IndexedDatasetWriter(prefix, np.uint16)
    for d in docs:
        w.add_document(d)
    w.prepare()
    return w


def test_interleaved_publications_leave_one_writers_pair(tmp_path, monkeypatch):
    """Two writers of one prefix without the lock: B publishes entirely between A's `.bin` and
    `.idx` renames. What is left is A's complete pair, which megatron-core reads."""
    prefix = str(tmp_path / "d")
    docs_a, docs_b = [[1, 2, 3], [4, 5]], [[7] * 10, [8] * 4, [9]]
    a, b = _writer(prefix, docs_a), _writer(prefix, docs_b)
    real_replace, done = os.replace, []

    def replace(src, dst, *args, **kw):
        real_replace(src, dst, *args, **kw)
        if dst == prefix + ".bin" and not done:
            done.append(True)
            b.publish()

    monkeypatch.setattr(os, "replace", replace)
    a.publish()
    monkeypatch.setattr(os, "replace", real_replace)
    header = validate_indexed_dataset(prefix, use_cache=False)
    ds = open_indexed_dataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == docs_a and header.num_tokens == 5
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]


def test_a_running_writers_temporaries_are_kept(tmp_path, sp_model, paragraphs):
    """Without the lock a second writer must not remove what a live one is writing."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(_jsonl(paragraphs[:50]))
    alive = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        os.makedirs(tmp_path / "out")
        theirs = str(tmp_path / "out" / f"c_text_document.bin.tmp-{alive.pid}-0a1b2c3d")
        open(theirs, "wb").close()
        dead = str(tmp_path / "out" / "c_text_document.bin.tmp-999999999")
        open(dead, "wb").close()
        preprocess([str(src)], str(tmp_path / "out" / "c"), SP, sp_model, **QUIET)
        assert os.path.exists(theirs) and not os.path.exists(dead)
    finally:
        alive.communicate(b"")


def test_two_unlocked_writers_publish_one_consistent_pair(tmp_path, sp_model, paragraphs):
    """Real processes with the lock bypassed (DLLM_TEST_NO_DATA_LOCK, testing only) on one prefix:
    the dataset left is one writer's, whole."""
    refs = []
    for name, part in (("a", paragraphs[:400]), ("b", paragraphs[400:600])):
        (tmp_path / f"{name}.jsonl").write_bytes(_jsonl(part))
        refs.append(preprocess([str(tmp_path / f"{name}.jsonl")], str(tmp_path / "ref" / name), SP, sp_model,
                               **QUIET).output_prefixes["text"])
    out = str(tmp_path / "out" / "c")
    env = _env(DLLM_TEST_NO_DATA_LOCK="1")
    procs = [subprocess.Popen([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"),
                               *_preprocess_args(str(tmp_path / f"{n}.jsonl"), out, sp_model, "--overwrite")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for n in ("a", "b")]
    results = [(p.wait(timeout=300), p.communicate()[1]) for p in procs]
    assert all(rc in (0, 2) for rc, _ in results), results
    assert any(rc == 0 for rc, _ in results), results
    prefix = out + "_text_document"
    validate_indexed_dataset(prefix, use_cache=False)
    pair = (open(prefix + ".bin", "rb").read(), open(prefix + ".idx", "rb").read())
    assert pair in [(open(r + ".bin", "rb").read(), open(r + ".idx", "rb").read()) for r in refs]
    assert len(open_indexed_dataset(prefix)) == validate_indexed_dataset(prefix).sequence_count
    assert not glob.glob(out + "*.tmp-*")


# ---------------------------------------------------------------- nothing replaced without --overwrite


@pytest.mark.parametrize("tool", ["preprocess", "merge", "convert", "sft"])
def test_an_existing_dataset_needs_overwrite(tmp_path, sp_model, paragraphs, tool):
    out = str(tmp_path / "out" / "o")
    if tool == "preprocess":
        src = tmp_path / "in.jsonl"
        src.write_bytes(_jsonl(paragraphs[:100]))
        runs = [("preprocess_data.py", *_preprocess_args(src, out, sp_model, *extra))
                for extra in ([], ["--append-eod"])]
        first_file = out + "_text_document.bin"
    elif tool == "merge":
        made = _made(tmp_path, sp_model, paragraphs)
        src = tmp_path / "in2.jsonl"
        src.write_bytes(_jsonl(paragraphs[100:150]))
        other = preprocess([str(src)], str(tmp_path / "made" / "q"), SP, sp_model, **QUIET).output_prefixes["text"]
        runs = [("merge_datasets.py", "--input", *inputs, "--output-prefix", out) for inputs in ([made], [made, other])]
        first_file = out + ".bin"
    elif tool == "convert":
        a = _litpkds_input(str(tmp_path / "a"), [5, 6, 2, 7])
        b = _litpkds_input(str(tmp_path / "b"), [5, 2, 9, 9, 2, 3, 3, 3])
        runs = [("convert_dataset.py", "--from", "litpkds", src, "--eos-id", 2, "--output-prefix", out)
                for src in (a, b)]
        first_file = out + ".bin"
    else:
        runs = [("preprocess_sft_data.py", "--input", _sft_input(tmp_path / f"s{n}.jsonl", n), "--output-prefix", out,
                 "--seq-length", 32, "--tokenizer-type", SP, "--tokenizer-model", sp_model) for n in (3, 6)]
        first_file = out + ".bin"
    assert _tool(*runs[0]).returncode == 0
    before = _md5s(os.path.dirname(out))
    r = _tool(*runs[1])
    _one_error_line(r, f"--output-prefix {out}: {first_file} already exists", "pass --overwrite to replace it")
    assert _md5s(os.path.dirname(out)) == before
    r = _tool(*runs[1], "--overwrite")
    assert r.returncode == 0, r.stderr[-2000:]
    after = _md5s(os.path.dirname(out))
    assert after[first_file] != before[first_file] and set(after) <= set(before) | {out + "_rejected.tsv"}
    if tool == "preprocess":  # --overwrite replaces files: a directory in an output's place is refused
        os.remove(first_file)
        os.mkdir(first_file)
        before = sorted(os.listdir(os.path.dirname(out)))
        _one_error_line(_tool(*runs[0], "--overwrite"), f"{first_file} is a directory, where an output file goes")
        assert sorted(os.listdir(os.path.dirname(out))) == before


def test_a_sidecar_the_writer_did_not_write_is_kept(tmp_path):
    out = str(tmp_path / "o")
    with open(meta_path(out), "w") as f:
        f.write('{"note": "written by hand"}')
    src = _litpkds_input(str(tmp_path), [5, 6, 2, 7])
    r = _tool("convert_dataset.py", "--from", "litpkds", src, "--eos-id", 2, "--output-prefix", out)
    _one_error_line(r, f"{meta_path(out)} already exists; pass --overwrite to replace it")
    assert open(meta_path(out)).read() == '{"note": "written by hand"}'
    assert not os.path.exists(out + ".bin") and not os.path.exists(out + ".idx")


def test_a_killed_run_reruns_without_overwrite(tmp_path, sp_model, paragraphs):
    """A run that died before publishing left only temporaries (and a file lock): no --overwrite needed."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(_jsonl(paragraphs[:100]))
    out = str(tmp_path / "c")
    open(out + "_text_document.bin.tmp-999999999-0a1b2c3d", "wb").close()
    with open(out + "_text_document.lock", "w") as f:  # the lock file of a writer that died
        json.dump({"host": os.uname().nodename, "pid": 999999999, "start_time": 0, "command": "x"}, f)
    r = _tool("preprocess_data.py", *_preprocess_args(src, out, sp_model), env=_env(DLLM_LOCK_MODE="file"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "taking over the lock left by pid 999999999" in r.stderr
    assert sorted(os.listdir(tmp_path)) == ["c_text_document.bin", "c_text_document.idx",
                                            "c_text_document.meta.json", "in.jsonl"]


# ---------------------------------------------------------------- what the data was made with


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    return tekken_vocab(tmp_path_factory.mktemp("vocab"), size=3000)


def test_tiktoken_options_are_recorded_and_enforced(tmp_path, vocab, paragraphs):
    from megatron_dllm.data.datasets import check_prefix
    from megatron_dllm.data.prep.sft_preprocess import preprocess_sft
    from megatron_dllm.data.sft import build_sft_datasets
    from megatron_dllm.data.tokenizers import build_tokenizer

    src = tmp_path / "in.jsonl"
    src.write_bytes(_jsonl(paragraphs[:50]))
    made = dict(pattern="v1", num_special_tokens=500, vocab_size=2000)
    prefix = preprocess([str(src)], str(tmp_path / "d"), "TikTokenizer", vocab, tokenizer_options=made,
                        append_eod=True, **QUIET).output_prefixes["text"]
    meta = read_metadata(prefix)
    assert (meta["tiktoken_pattern"], meta["tiktoken_num_special_tokens"], meta["vocab_size"]) == ("v1", 500, 2000)
    assert meta["tokenizer_special_tokens"][:3] == ["<unk>", "<s>", "</s>"]
    check_prefix(prefix, "--data-path", build_tokenizer("TikTokenizer", vocab, **made), None)
    m = re.escape(meta_path(prefix))
    cases = [(dict(made, num_special_tokens=1000), f"--tiktoken-num-special-tokens 1000 but {m} records 500"),
             (dict(made, pattern="v2"), f"--tiktoken-pattern v2 but {m} records v1")]
    for options, message in cases:
        with pytest.raises(ValueError, match="--data-path: " + message):
            check_prefix(prefix, "--data-path", build_tokenizer("TikTokenizer", vocab, **options), None)
    # training through its own entry (build_indexes resolves the run as pretrain_dllm.py does)
    argv = ["--family", "mdlm", "--preset", "cpu-tiny", "--data-path", prefix, "--split", "90,10,0",
            "--seq-length", 32, "--train-iters", 2, "--global-batch-size", 2, "--micro-batch-size", 2,
            "--eval-interval", 100, "--eval-iters", 1, "--tokenizer-type", "TikTokenizer", "--tokenizer-model", vocab,
            "--tiktoken-pattern", "v1", "--tiktoken-num-special-tokens", 1000, "--vocab-size", 2000,
            "--data-cache-path", tmp_path / "cache"]
    r = _tool("build_indexes.py", *argv)
    _one_error_line(r, f"--tiktoken-num-special-tokens 1000 but {meta_path(prefix)} records 500")
    # tools/evaluate.py nelbo resolves its data through the same path
    from megatron_dllm.config.data import DataConfig, TokenizerConfig
    from megatron_dllm.evaluation.nelbo import validation_run

    with pytest.raises(ValueError, match=f"--tiktoken-num-special-tokens 1000 but {m} records 500"):
        validation_run("mdlm", 32, DataConfig(data_path=[prefix], split="90,10,0",
                                              data_cache_path=str(tmp_path / "cache")),
                       TokenizerConfig("TikTokenizer", vocab, tiktoken_pattern="v1", tiktoken_num_special_tokens=1000,
                                       vocab_size=2000), global_batch_size=2, eval_iters=1, seed=1)
    # SFT data the same way
    sft_prefix = str(tmp_path / "sft")
    preprocess_sft([_sft_input(tmp_path / "s.jsonl")], sft_prefix, build_tokenizer("TikTokenizer", vocab, **made), 32)
    with pytest.raises(ValueError, match=f"--data-path: --tiktoken-pattern v2 but {re.escape(meta_path(sft_prefix))} "
                                         f"records v1"):
        build_sft_datasets([sft_prefix], "80,20,0", None, 32, False, 1,
                           build_tokenizer("TikTokenizer", vocab, **dict(made, pattern="v2")), True)
    # an older sidecar without these fields is accepted, as before
    with open(meta_path(prefix), "w") as f:
        json.dump({k: v for k, v in meta.items() if not k.startswith(("tiktoken_", "tokenizer_special"))}, f)
    check_prefix(prefix, "--data-path", build_tokenizer("TikTokenizer", vocab, **cases[0][0]), None)


# ---------------------------------------------------------------- bad input


def test_non_utf8_sft_input_names_file_and_line(tmp_path, sp_model):
    src = tmp_path / "s.jsonl"
    src.write_bytes(b'{"prompt": "a", "response": "b"}\n{"prompt": "\xff\xfe", "response": "b"}\n')
    out = str(tmp_path / "out" / "o")
    r = _tool("preprocess_sft_data.py", "--input", src, "--output-prefix", out, "--seq-length", 32,
              "--tokenizer-type", SP, "--tokenizer-model", sp_model)
    _one_error_line(r, f"error: {src}:2: not valid UTF-8")
    assert not glob.glob(out + "*")


@pytest.mark.parametrize("tool", ["merge", "convert", "sft", "build_indexes"])
def test_read_only_output_directory_is_one_line(tmp_path, sp_model, paragraphs, tool):
    with tmpfs(tmp_path / "ro", "1m", read_only=True) as ro:
        out = os.path.join(ro, "o")
        if tool == "merge":
            argv = ("merge_datasets.py", "--input", _made(tmp_path, sp_model, paragraphs), "--output-prefix", out)
        elif tool == "convert":
            argv = ("convert_dataset.py", "--from", "litpkds", _litpkds_input(str(tmp_path), [5, 6, 2, 7]),
                    "--eos-id", 2, "--output-prefix", out)
        elif tool == "sft":
            argv = ("preprocess_sft_data.py", "--input", _sft_input(tmp_path / "s.jsonl"), "--output-prefix", out,
                    "--seq-length", 32, "--tokenizer-type", SP, "--tokenizer-model", sp_model)
        else:
            argv = ("build_indexes.py", *_build_indexes_args(_made(tmp_path, sp_model, paragraphs), sp_model, ro))
        flag = f"--data-cache-path {ro}" if tool == "build_indexes" else f"--output-prefix {out}"
        _one_error_line(_tool(*argv), f"{flag}: cannot write to {ro} (Read-only file system)")
