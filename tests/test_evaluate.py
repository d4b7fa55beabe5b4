"""Evaluation (tools/evaluate.py, megatron_dllm/evaluation): the NELBO of a trained model equals the
training-time validation figure (megatron checkpoint and exported HF dir), Gen PPL separates real
from shuffled text under a real judge (SmolLM2-135M), the exported AR model works as a judge and
scores exactly as the AR family's NLL, entropy and the first-EOS mask against hand-computed values,
and bad input gives one `error:` line with exit code 2."""
import importlib
import json
import math
import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import REPO, run_pretrain

FAMILIES = ["ar", "mdlm", "duo", "mdlm-shift", "bd3lm"]  # mdlm-shift: MDLM trained with --shift
RUN = ["--preset", "cpu-tiny", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
       "--train-iters", "2", "--lr", "1e-2", "--lr-warmup-iters", "0", "--eval-interval", "100",
       "--eval-iters", "2"]
EVAL = ["--global-batch-size", "4", "--eval-iters", "2"]  # the training run's validation settings


from megatron_dllm.cli import evaluate  # noqa: E402


@pytest.fixture(scope="module")
def trained(demo_cache, tmp_path_factory):
    """{family: (checkpoint, training-time valid_nelbo)}, plus the AR and MDLM models exported to HF."""
    root = tmp_path_factory.mktemp("eval_ckpts")

    def train(name):
        work = root / name
        work.mkdir()
        family = ["--family", name.split("-")[0]] + (["--shift"] if name.endswith("-shift") else []) \
            + (["--block-size", "8"] if name == "bd3lm" else [])
        _, records = run_pretrain(1, ["--demo-cache-dir", demo_cache, *family, *RUN,
                                      "--save", str(work / "ckpt"), "--tensorboard-dir", str(work / "tb")], work)
        valid = [r["valid_nelbo"] for r in records if "valid_nelbo" in r]
        assert len(valid) == 1, records
        return name, (str(work / "ckpt"), valid[0])

    with ThreadPoolExecutor(len(FAMILIES)) as pool:  # separate processes: train concurrently
        out = dict(pool.map(train, FAMILIES))
    from megatron_dllm import platform
    from megatron_dllm.data.prep.demo import prepare_demo_corpus

    tok = prepare_demo_corpus(demo_cache)["tokenizer_model"]
    convert = importlib.import_module("megatron_dllm.cli.convert_to_hf")
    try:
        for family in ("ar", "mdlm", "mdlm-shift"):
            hf = str(root / family / "hf")
            assert convert.main(["--load", out[family][0], "--out", hf, "--tokenizer-type",
                                 "SentencePieceTokenizer", "--tokenizer-model", tok]) == 0
            out[f"{family}-hf"] = (hf, out[family][1])
    finally:
        platform.destroy_distributed()
    return out


def _evaluate(argv, tmp_path, name="out.json"):
    path = str(tmp_path / name)
    assert evaluate.main([*argv, "--output", path]) == 0
    with open(path) as f:
        return json.load(f)


def _error(argv, capsys):
    """Run a failing command: exit code 2 and exactly one `error: ...` line, no traceback."""
    capsys.readouterr()
    assert evaluate.main(argv) == 2
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if not line.startswith("[")]  # [demo corpus]/[judge] notes
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


# --------------------------------------------------------------------------- NELBO


@pytest.mark.slow
@pytest.mark.parametrize("which", ["mdlm", "duo", "ar", "mdlm-hf", "ar-hf", "mdlm-shift", "mdlm-shift-hf", "bd3lm"])
def test_nelbo_equals_training_validation(trained, demo_cache, tmp_path, which, monkeypatch):
    ckpt, valid_nelbo = trained[which]
    res = _evaluate(["nelbo", "--load", ckpt, "--demo-cache-dir", demo_cache, *EVAL], tmp_path)
    if which == "mdlm-shift":  # the figure needs the shift: the same evaluation without it differs
        monkeypatch.setattr("megatron_dllm.families.mdlm.shift_right", lambda logits, dim: logits)
        unshifted = _evaluate(["nelbo", "--load", ckpt, "--demo-cache-dir", demo_cache, *EVAL], tmp_path, "no.json")
        assert abs(unshifted["nelbo"] - valid_nelbo) > 1e-3 * valid_nelbo, (unshifted["nelbo"], valid_nelbo)
    assert math.isfinite(res["nelbo"]) and res["nelbo"] > 0
    assert abs(res["nelbo"] - valid_nelbo) <= 1e-5 * valid_nelbo, (res["nelbo"], valid_nelbo)
    assert res["family"] == which.split("-")[0]
    assert res["shift"] == ("-shift" in which)  # recorded by the checkpoint and by the export
    assert res["tokens"] == 2 * 4 * 32 and res["samples"] == 8
    assert res["ppl"] == pytest.approx(math.exp(res["nelbo"]))
    assert res["bpd"] == pytest.approx(res["nelbo"] / math.log(2))
    s = res["settings"]
    assert (s["seed"], s["noise_seed"], s["global_batch_size"], s["eval_iters"], s["seq_length"], s["demo"]) == \
        (1234, 1235, 4, 2, 32, True)


@pytest.mark.slow
def test_nelbo_t_draws_average_and_keep_draw_zero(trained, demo_cache, tmp_path):
    ckpt, valid_nelbo = trained["mdlm-hf"]
    res = _evaluate(["nelbo", "--load", ckpt, "--demo-cache-dir", demo_cache, *EVAL, "--num-t-draws", "3",
                     "--micro-batch-size", "1"], tmp_path)
    draws = res["nelbo_per_draw"]
    assert len(draws) == 3 and res["settings"]["num_t_draws"] == 3
    assert abs(draws[0] - valid_nelbo) <= 1e-5 * valid_nelbo  # draw 0 is the training-time noise
    assert len(set(draws)) == 3  # the other draws have noise of their own
    assert res["nelbo"] == pytest.approx(sum(draws) / 3, rel=1e-12)  # equal token counts per draw


# --------------------------------------------------------------------------- Gen PPL, entropy


def test_entropy_against_hand_computed_value():
    from megatron_dllm.evaluation.entropy import mean_entropy, unigram_entropy

    # [1, 1, 2, 3]: p = 1/2, 1/4, 1/4 -> H = 1/2 ln 2 + 2 * 1/4 ln 4 = 1.5 ln 2
    assert unigram_entropy([1, 1, 2, 3]) == pytest.approx(1.5 * math.log(2), rel=1e-12)
    assert unigram_entropy([7, 7, 7]) == 0.0
    assert unigram_entropy(list(range(8))) == pytest.approx(math.log(8), rel=1e-12)
    assert mean_entropy([[1, 1, 2, 3], [7, 7, 7, 7]]) == pytest.approx(0.75 * math.log(2), rel=1e-12)


def test_first_eos_mask_against_hand_made_example():
    from megatron_dllm.evaluation.gen_ppl import first_eos_mask

    eos = 2
    ids = torch.tensor([[5, 6, 2, 2, 7, 2],    # text, first EOS, later EOS, text, EOS
                        [2, 5, 2, 2, 2, 2],    # leading EOS is the first EOS; padding (id = EOS) at the end
                        [5, 6, 7, 8, 0, 0]])   # no EOS; padding
    attention = torch.tensor([[1, 1, 1, 1, 1, 1],
                              [1, 1, 1, 0, 0, 0],
                              [1, 1, 1, 1, 0, 0]])
    expected = torch.tensor([[1, 1, 1, 0, 1, 0],
                             [1, 1, 0, 0, 0, 0],
                             [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    assert torch.equal(first_eos_mask(ids, attention, eos), expected)
    assert torch.equal(first_eos_mask(ids, attention, None), attention.bool())


def _validation_passages(demo_cache, n=8):
    """Held-out English text: paragraphs of the demo corpus's validation play."""
    with open(os.path.join(demo_cache, "valid.jsonl")) as f:
        text = json.loads(f.readline())["text"]
    paragraphs = [" ".join(p.split()) for p in text.split("\n\n")]
    return [p for p in paragraphs if len(p) > 300][:n]


@pytest.fixture(scope="module")
def smollm2():
    """The real judge: installed, converted and cached under ~/.cache/megatron_dllm/judges once."""
    from megatron_dllm.evaluation.judge import load_judge

    return load_judge("smollm2")


@pytest.mark.slow
def test_gen_ppl_real_text_far_below_shuffled(smollm2, demo_cache):
    from megatron_dllm.evaluation.gen_ppl import generative_perplexity

    real = _validation_passages(demo_cache, 6)
    rng = random.Random(0)
    shuffled = [" ".join(rng.sample(p.split(), len(p.split()))) for p in real]
    assert len(real) == 6 and shuffled != real
    a = generative_perplexity(smollm2, real, batch_size=4, max_length=64)  # 64 judge tokens keep CPU time low
    b = generative_perplexity(smollm2, shuffled, batch_size=4, max_length=64)
    assert math.isfinite(a.gen_ppl) and a.tokens == 6 * 63
    assert b.gen_ppl > 4 * a.gen_ppl, (a.gen_ppl, b.gen_ppl)
    print(f"SmolLM2-135M Gen PPL: real {a.gen_ppl:.1f}, shuffled {b.gen_ppl:.1f}")
    # padding never counts: batch composition does not change a sample's score
    c = generative_perplexity(smollm2, real[:3] + ["A short line."], batch_size=4, max_length=64)
    d = generative_perplexity(smollm2, real[:3] + ["A short line."], batch_size=1, max_length=64)
    assert d.per_sample_nll == pytest.approx(c.per_sample_nll, rel=1e-4)
    assert c.per_sample_nll[:3] == pytest.approx(a.per_sample_nll[:3], rel=1e-4)


@pytest.mark.slow
def test_exported_ar_model_is_a_judge_with_the_ar_nll(trained, demo_cache):
    from megatron_dllm import platform
    from megatron_dllm.evaluation.gen_ppl import generative_perplexity, score_ids
    from megatron_dllm.evaluation.judge import load_judge
    from megatron_dllm.families import get_family
    from megatron_dllm.families.base import Noise
    from megatron_dllm.sampling.loading import load_inference_model

    hf = trained["ar-hf"][0]
    judge = load_judge(hf)
    assert judge.context == 32 and judge.suppress_ids == [judge.model.config.mask_token_id]
    # its NLL on tokens equals the AR family's exact NLL on the same tokens
    inf = load_inference_model(hf)
    torch.manual_seed(0)
    ids = torch.randint(3, inf.vocab_size - 1, (3, 33))
    ids[ids == judge.eos_id] = 5
    sums, counts = score_ids(judge.model, ids, torch.ones_like(ids), judge.eos_id, judge.suppress_ids)
    family = get_family("ar", inf.mask_id, inf.vocab_size)
    platform.init_distributed(1, 1)
    try:
        inp = family.corrupt(ids, Noise(0, torch.arange(3), torch.arange(3), 3))
        with torch.no_grad():
            inf.model.to(platform.device())  # NCCL reduces device tensors only
            inp = inp.to(platform.device())
            logits = inf.model(input_ids=inp.input_ids, position_ids=inp.position_ids, sigma=inp.sigma).logits
        nll = family.nelbo(logits.transpose(0, 1).contiguous(), inp).double().sum(1).to(sums.device)
    finally:
        platform.destroy_distributed()
    assert counts.tolist() == [32, 32, 32]
    torch.testing.assert_close(sums, nll, rtol=1e-6, atol=0)
    # long texts are cut to the judge's 32-token context
    res = generative_perplexity(judge, _validation_passages(demo_cache, 3), batch_size=2)
    assert math.isfinite(res.gen_ppl) and res.truncated == 3 and res.tokens == 3 * 31
    # empty samples (a model that wrote only EOD) fill a batch of their own: scored as nothing
    res = generative_perplexity(judge, ["", ""] + _validation_passages(demo_cache, 1), batch_size=2)
    assert res.per_sample_nll[:2] == [None, None] and res.tokens == 31
    with pytest.raises(ValueError, match="no token to score"):  # InputError
        generative_perplexity(judge, ["", ""], batch_size=2)



@pytest.mark.slow
def test_gen_ppl_of_tools_sample_output(trained, tmp_path):
    """tools/sample.py -> gen-ppl: JSON keys, sampling settings carried over, entropy of the model's ids."""
    from megatron_dllm import platform
    from megatron_dllm.evaluation.entropy import mean_entropy

    samples = str(tmp_path / "samples.json")
    try:
        assert importlib.import_module("megatron_dllm.cli.sample").main(
            ["--load", trained["mdlm"][0], "--num-samples", "4", "--steps", "4", "--output", samples]) == 0
    finally:
        platform.destroy_distributed()
    with open(samples) as f:
        tokens = json.load(f)["tokens"]
    hf = trained["ar-hf"][0]
    res = _evaluate(["gen-ppl", "--samples", samples, "--judge", hf, "--batch-size", "2"], tmp_path)
    assert (res["family"], res["steps"], res["sampling"]["predictor"]) == ("mdlm", 4, "ancestral")
    assert math.isfinite(res["gen_ppl"]) and res["gen_ppl"] > 1 and res["num_samples"] == 4
    assert res["entropy"] == pytest.approx(mean_entropy(tokens), rel=1e-12) and res["entropy"] > 0
    assert res["judge"]["path"] == hf and res["judge"]["context"] == 32
    assert res["settings"]["batch_size"] == 2


@pytest.mark.slow
def test_throughput_with_auto_batch_size(trained, tmp_path):
    res = _evaluate(["throughput", "--load", trained["mdlm"][0], "--steps", "4", "--batch-size", "auto",
                     "--max-batch-size", "2", "--repeats", "2"], tmp_path)
    assert (res["family"], res["steps"], res["batch_size"], res["seq_length"]) == ("mdlm", 4, 2, 32)
    assert len(res["seconds_per_batch"]) == 2 and res["tokens_per_s"] > 0
    assert res["tokens_per_s"] == pytest.approx(32 * res["samples_per_s"])
    assert res["samples_per_s"] == pytest.approx(4 / sum(res["seconds_per_batch"]))
    assert res["settings"]["sampling"]["steps"] == 4 and res["settings"]["sampling"]["stop_at_eos"] is False


def test_plain_text_and_jsonl_samples(tmp_path):
    from megatron_dllm.errors import InputError
    from megatron_dllm.evaluation.samples import read_samples

    (tmp_path / "a.txt").write_text("first sample\n\nsecond sample\n")
    (tmp_path / "b.jsonl").write_text('"first"\n{"text": "second", "tokens": [1, 2]}\n')
    assert read_samples(str(tmp_path / "a.txt")).texts == ["first sample", "second sample"]
    with pytest.raises(ValueError, match="some samples have `tokens`"):
        read_samples(str(tmp_path / "b.jsonl"))
    (tmp_path / "c.jsonl").write_text('{"text": "t", "tokens": [3, 4]}\n')
    assert read_samples(str(tmp_path / "c.jsonl")).tokens == [[3, 4]]
    # malformed files are one InputError naming --samples, never a traceback from deeper down
    for name, content, why in [("d.txt", b"caf\xe9\n", r"not UTF-8 text \(byte 3\)"),
                               ("e.json", b'{"texts": ["a"], "tokens": [["x"]]}', "`tokens` must hold one non-empty"),
                               ("f.json", b'{"texts": ["a"], "tokens": 5}', "`tokens` must hold one non-empty"),
                               ("g.jsonl", b'{"text": "a", "tokens": []}\n', "`tokens` must hold one non-empty"),
                               ("h.jsonl", b'{"text": "a", "tokens": "abc"}\n', "`tokens` must hold one non-empty")]:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(InputError, match=f"--samples {tmp_path / name}: {why}"):
            read_samples(str(tmp_path / name))


# --------------------------------------------------------------------------- errors


@pytest.mark.slow
def test_errors_name_the_flag_or_file(trained, tmp_path, capsys):
    missing = str(tmp_path / "missing")
    assert "--load" in _error(["nelbo", "--load", missing], capsys)
    assert missing in _error(["throughput", "--load", missing, "--steps", "4"], capsys)
    assert "--judge" in _error(["gen-ppl", "--samples", os.path.join(REPO, "README.md"), "--judge", missing], capsys)
    samples = tmp_path / "s.txt"
    samples.write_text("some text\n")
    assert "--samples" in _error(["gen-ppl", "--samples", str(tmp_path / "none.json"), "--judge", missing], capsys)
    # a masked diffusion model is not a causal LM; a megatron checkpoint is not an HF directory
    msg = _error(["gen-ppl", "--samples", str(samples), "--judge", trained["mdlm-hf"][0]], capsys)
    assert msg.startswith(f"error: --judge {trained['mdlm-hf'][0]}: a mdlm model is not a causal LM")
    assert "--judge" in _error(["gen-ppl", "--samples", str(samples), "--judge", trained["ar"][0]], capsys)
    assert "--num-t-draws" in _error(["nelbo", "--load", trained["mdlm"][0], "--num-t-draws", "0"], capsys)
    assert _error(["nelbo", "--load", trained["mdlm"][0], "--seq-length", "64"], capsys) == \
        "error: --seq-length 64 exceeds the model's context 32"
    assert "--max-length: expected a positive integer, got -5" in _error(
        ["gen-ppl", "--samples", str(samples), "--judge", missing, "--max-length", "-5"], capsys)
    assert "--max-length 1: expected an integer >= 2" in _error(
        ["gen-ppl", "--samples", str(samples), "--judge", missing, "--max-length", "1"], capsys)
    recorded = tmp_path / "recorded.json"  # a samples file's seq_length of another type
    recorded.write_text(json.dumps({"texts": ["some text"], "seq_length": "64"}))
    assert f"--samples {recorded}: seq_length '64': expected an integer >= 2" in _error(
        ["gen-ppl", "--samples", str(recorded), "--judge", missing], capsys)
    # the samples are an input: never replaced by the result, --overwrite or not
    assert f"--output {recorded}: the same file as --samples (an input)" in _error(
        ["gen-ppl", "--samples", str(recorded), "--judge", "smollm2", "--output", str(recorded), "--overwrite"],
        capsys)
    assert "--judge-gguf-file other.gguf: applies to a --judge directory" in _error(
        ["gen-ppl", "--samples", str(samples), "--judge", "smollm2", "--judge-gguf-file", "other.gguf"], capsys)
    # a sampler of another family; auto batch size on CPU without a cap
    ckpt = trained["mdlm"][0]
    assert "--predictor block" in _error(["throughput", "--load", ckpt, "--steps", "4", "--batch-size", "2",
                                          "--predictor", "block"], capsys)
    if not torch.cuda.is_available():  # on a GPU, auto runs uncapped: a doubling search up to the first OOM
        assert "--max-batch-size" in _error(["throughput", "--load", ckpt, "--steps", "4"], capsys)
    assert "--max-batch-size caps --batch-size auto; with --batch-size 2 it does nothing" in _error(
        ["throughput", "--load", ckpt, "--steps", "4", "--batch-size", "2", "--max-batch-size", "4"], capsys)
