"""benchmarks/bench_gpu_generation.py on CPU at a tiny shape, in process: the token counts and rates
of its tables are those of the samples its timed runs actually produced, and the paper's own
samplers run beside ours (where the paper code's snapshot and its packages are present)."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import load_benchmark

from megatron_dllm.data.tokenizers import build_tokenizer

# a git repository (a clone, or a bare mirror) of the paper's public code, where the machine has one
PAPER_REPO = os.environ.get("DLLM_PAPER_CODE_REPO", "")
PAPER_FILES = ["*.py", "models", "configs", "tokenizers/tinyllama_tokenizer.model"]  # its 128k vocabulary is not needed


def recording(fn, log: list):
    """`fn`, appending (first argument, result) to `log` for every call that returns."""
    def wrapper(inf, *args, **kwargs):
        out = fn(inf, *args, **kwargs)
        log.append((inf.family, out))
        return out
    return wrapper


def test_table_counts_the_tokens_the_runs_produced(monkeypatch, tmp_path, sp_model):
    bench = load_benchmark("bench_gpu_generation")
    samples, answers = [], []
    monkeypatch.setattr(bench, "generate", recording(bench.generate, samples))
    monkeypatch.setattr(bench, "generate_native", recording(bench.generate_native, answers))
    problems = tmp_path / "gsm8k.jsonl"
    problems.write_text("".join(json.dumps({"question": q, "answer": "#### 4"}) + "\n"
                                for q in ("What is two plus two?", "How many legs has a dog?")))
    out = tmp_path / "figures.json"
    figures = bench.main(["--presets", "cpu-micro", "--families", "mdlm", "ar", "--lengths", "32", "--steps", "4",
                          "--vocab", "4097", "--rounds", "1", "--max-batch", "2", "--tokenizer-model", sp_model,
                          "--gsm8k-data", str(problems), "--prompts", "2", "--max-new-tokens", "6", "--json", str(out)])
    assert json.loads(out.read_text())["unconditional"] == json.loads(json.dumps(figures["unconditional"]))

    rows = {row["family"]: row for row in figures["unconditional"]}
    assert set(rows) == {"mdlm", "ar"} and all(row["sampler"] == "ours, graphs off" for row in rows.values())
    produced = dict(samples)  # one timed run per family (probes stop early and return nothing)
    assert len(samples) == 2
    for family, row in rows.items():
        tokens = produced[family]
        assert tokens.shape == (row["batch"], 32) and row["batch"] == 2  # the largest power of two up to --max-batch
        assert not (tokens == 4096).any()  # no [MASK] left
        start = 1 if family == "ar" else 0  # AR's start token is not generated
        assert row["tokens"] == tokens[:, start:].numel()
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["wall_s"])
    assert rows["ar"]["calls"] == 31 and 1 <= rows["mdlm"]["calls"] <= 5

    eos = build_tokenizer("SentencePieceTokenizer", sp_model).eod
    cond = {row["family"]: row for row in figures["conditional"]}
    assert set(cond) == {"mdlm", "ar"}
    for family, row in cond.items():
        warm, ids = [a for f, a in answers if f == family][:-2], [a for f, a in answers if f == family][-2:]
        assert len(warm) == 2 and all(1 <= len(a) <= 2 for a in warm)  # untimed: compiles before the timing
        assert all(1 <= len(a) <= 6 for a in ids)
        assert row["tokens"] == sum(map(len, ids))
        assert row["ended_at_eos"] == sum(a[-1] == eos for a in ids)


@pytest.mark.slow
def test_paper_samplers_beside_ours(tmp_path):
    """The paper's AR and Eso-LM samplers (no FlexAttention compile on CPU: their KV-cache paths use
    plain matmuls) on its own DiT, from a git repository of its code (`DLLM_PAPER_CODE_REPO`). CI has
    neither the code nor its packages (lightning, torchmetrics): there this test is skipped."""
    missing = [m for m in ("lightning", "torchmetrics", "omegaconf", "einops") if importlib.util.find_spec(m) is None]
    if not os.path.isdir(PAPER_REPO) or shutil.which("git") is None or missing:
        pytest.skip(f"needs DLLM_PAPER_CODE_REPO (a git repository of the paper's code; now {PAPER_REPO!r}) "
                    f"and its packages (missing: {missing})")
    code = tmp_path / "paper-code"
    code.mkdir()
    archive = subprocess.run(["git", "-C", PAPER_REPO, "archive", "HEAD", "--", *PAPER_FILES],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(code)], input=archive, check=True)
    bench = load_benchmark("bench_gpu_generation")
    figures = bench.main(["--presets", "cpu-micro", "--families", "ar", "esolm", "--lengths", "32", "--steps", "4",
                          "--vocab", "64", "--rounds", "1", "--max-batch", "2", "--sections", "unconditional",
                          "--paper-code", str(code)])
    rows = {(row["family"], row["sampler"]): row for row in figures["unconditional"]}
    assert set(rows) == {(f, s) for f in ("ar", "esolm") for s in ("ours, graphs off", "paper")}
    for (family, _), row in rows.items():
        assert row["batch"] == 2 and row["tokens"] == 2 * (32 - (family == "ar"))
    assert rows["ar", "paper"]["calls"] == rows["ar", "ours, graphs off"]["calls"] == 31  # one call per token
    assert 1 <= rows["esolm", "paper"]["calls"] <= 4


class FailingPaperSampler:
    """Stands in for `paper_samplers.PaperSampler`: the paper's code raising where a GPU session
    could meet it (building its model, or sampling)."""

    fail_in_init = False

    def __init__(self, path, family, preset, vocab, length, steps, device, bos_id):
        if self.fail_in_init:
            raise ImportError("cannot import name 'flex_attention' from its module")
        self.family, self.steps, self.calls = family, steps, 0

    def host_batch_limit(self):
        return None

    def sample(self, batch):
        raise RuntimeError("FlexAttention: no kernel for\nthis | shape")


@pytest.mark.parametrize("where", ["sample", "init"])
def test_a_failing_paper_sampler_is_noted_and_ours_still_run(monkeypatch, tmp_path, where):
    """The paper's code is the user's: when it raises, its row carries the error on one line and
    every row of ours is still measured (a GPU session keeps its figures)."""
    bench = load_benchmark("bench_gpu_generation")
    fake = type(sys)("paper_samplers")
    fake.PaperSampler = type("Failing", (FailingPaperSampler,), {"fail_in_init": where == "init"})
    monkeypatch.setitem(sys.modules, "paper_samplers", fake)
    figures = bench.main(["--presets", "cpu-micro", "--families", "mdlm", "ar", "--lengths", "16", "--steps", "2",
                          "--vocab", "64", "--rounds", "1", "--max-batch", "2", "--sections", "unconditional",
                          "--paper-code", str(tmp_path)])
    rows = {(row["family"], row["sampler"]): row for row in figures["unconditional"]}
    assert set(rows) == {(f, s) for f in ("mdlm", "ar") for s in ("ours, graphs off", "paper")}
    error = ("ImportError: cannot import name 'flex_attention' from its module" if where == "init"
             else "RuntimeError: FlexAttention: no kernel for this / shape")
    for family in ("mdlm", "ar"):
        assert rows[family, "paper"]["note"] == [f"the paper's code failed: {error}"]
        assert "tokens" not in rows[family, "paper"]
        ours = rows[family, "ours, graphs off"]
        assert ours["batch"] == 2 and ours["tokens"] == 2 * (16 - (family == "ar")) and not ours["note"]
