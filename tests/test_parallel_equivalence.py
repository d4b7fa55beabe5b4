"""Same weights and batch: every parallel layout trains like the single-process run.

Each case runs the Trainer (gloo on CPU) for three iterations from fully random weights and
compares loss, gradient norm and validation NELBO with TP=1 PP=1 DP=1. Weights start identical in
every layout (layout-independent init) and the noise is a function of the global sample index, so
only the order of floating-point reductions differs.

Two launches run every case: one process for the single-process references, one 2-rank torchrun
for all the layouts, one after another (`parallel_worker.py`; each Trainer re-initialises
megatron's model-parallel state for its layout). A launch per layout cost a process start, the
torch and megatron imports and a rendezvous each, about 5.5 min for the file on 2 cores.
"""
import json
import os

import pytest
from conftest import launch_env, run_python

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

HERE = os.path.dirname(os.path.abspath(__file__))
SMALL = ["--preset", "cpu-tiny", "--num-layers", "4", "--seq-length", "32", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-3", "--lr-warmup-iters", "0",
         "--lr-decay-style", "constant", "--eval-interval", "3", "--eval-iters", "1"]
VARIABLE = ["--variable-seq-length-prob", "0.5"]  # half the micro-batches cut short

LAYOUTS = {
    "TP2": ["--tensor-model-parallel-size", "2"],
    "TP2-SP": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "PP2": ["--pipeline-model-parallel-size", "2"],
    "PP2-VPP2": ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"],
    "DP2": [],
    "DP2-distopt-overlap": ["--use-distributed-optimizer", "--overlap-grad-reduce"],
    "DP2-recompute": ["--recompute-activations"],
}

# Every layout for MDLM; for the other families the layouts that touch family-specific paths (TP
# shards the loss heads, PP carries the time input and AR's extra token between stages; SP,
# recompute and the DP variants are family-agnostic machinery), to keep the suite short.
# BD3-LM carries its block mask and a doubled sequence ([x_t ; x_0]) between PP stages and through
# sequence parallelism; its uniform noise runs Duo's sharded head with per-token t.
CASES = [("mdlm", layout) for layout in LAYOUTS] + [("ar", layout) for layout in ("TP2", "PP2-VPP2")] + \
        [(f, layout) for f in ("duo", "esolm") for layout in ("TP2", "PP2")] + \
        [("bd3lm", layout) for layout in ("TP2", "TP2-SP", "PP2")] + [("bd3lm-uniform", "TP2")]
FAMILY_FLAGS = {"bd3lm": ["--family", "bd3lm", "--block-size", "8"],
                "bd3lm-uniform": ["--family", "bd3lm", "--block-size", "8", "--noise", "uniform"]}


def family_flags(name: str) -> list[str]:
    return FAMILY_FLAGS.get(name, ["--family", name])


def run_worker(nproc: int, cases: dict, workdir, demo_cache: str) -> tuple[dict, str]:
    """Run `cases` ({name: flags}) in one launch of `nproc` ranks: ({name: metrics} of the cases
    that completed, the launch's output tail)."""
    out = workdir / "results"
    out.mkdir()
    argv = {name: ["--demo-cache-dir", demo_cache, "--save", str(workdir / f"ckpt-{name}"), *flags]
            for name, flags in cases.items()}
    (workdir / "cases.json").write_text(json.dumps(argv))
    script = [os.path.join(HERE, "parallel_worker.py"), str(out), str(workdir / "cases.json")]
    proc = run_python(script, workdir, launch_env(nproc), 1800, nproc)
    results = {p[:-5]: json.loads((out / p).read_text()) for p in os.listdir(out)}
    return results, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"


@pytest.fixture(scope="module")
def runs(demo_cache, tmp_path_factory):
    """Every case of this file, run once: the references in one process, the layouts in one
    2-rank launch."""
    reference = {family: [*family_flags(family), *SMALL]
                 for family in ("ar", "mdlm", "duo", "esolm", "bd3lm", "bd3lm-uniform")}
    reference["mdlm-variable"] = ["--family", "mdlm", *SMALL, *VARIABLE]
    layouts = {f"{family}-{layout}": [*family_flags(family), *SMALL, *LAYOUTS[layout]] for family, layout in CASES}
    layouts["mdlm-variable-PP2"] = ["--family", "mdlm", *SMALL, *VARIABLE, "--pipeline-model-parallel-size", "2"]
    return (run_worker(1, reference, tmp_path_factory.mktemp("one"), demo_cache),
            run_worker(2, layouts, tmp_path_factory.mktemp("two"), demo_cache))


def results(runs, reference: str, case: str) -> tuple[dict, dict]:
    (ones, one_log), (twos, two_log) = runs
    assert reference in ones, f"the single-process reference {reference} did not complete:\n{one_log}"
    assert case in twos, f"the 2-rank case {case} did not complete:\n{two_log}"
    return ones[reference], twos[case]


@pytest.mark.parametrize("family,layout", CASES)
def test_layout_matches_single_process(family, layout, runs):
    ref, got = results(runs, family, f"{family}-{layout}")
    assert got["same_noise_in_dp_group"]  # every TP rank and PP stage drew the same z_t, sigma, t
    assert ref["grad_norm"][0] > 0.1  # random weights: every layer carries gradient
    assert got["loss"] == pytest.approx(ref["loss"], rel=2e-5)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=2e-5)
    assert got["valid"] == pytest.approx(ref["valid"], rel=2e-5)


def test_variable_length_micro_batches_match_across_pipeline_stages(runs):
    """With half the micro-batches cut short, PP=2 (stages exchange shapes) equals one process."""
    ref, got = results(runs, "mdlm-variable", "mdlm-variable-PP2")
    assert got["loss"] == pytest.approx(ref["loss"], rel=2e-5)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=2e-5)
