"""The tools load an HF export with this project's own classes: python files shipped in an export
(`modeling_dllm.py`, `configuration_dllm.py`, the sampler files behind `generate`, a tokenizer
module named by an `auto_map`), which anyone passing the export on can edit, never run. Each loader
(sample, evaluate nelbo and gen-ppl with the exported AR judge, convert_from_hf, the lm-eval model
class, `generate` of the loaded model) is run on an export whose python files write a marker file
when imported: no marker appears, and every result equals the one of the untouched export."""
import json
import os
import shutil

import numpy as np
import pytest
import torch
from test_convert_from_ref import random_paper_model, save_lightning, train_sentencepiece

from megatron_dllm.cli import convert_from_ref

VOCAB = 450  # room for SentencePiece's byte pieces; the last id is the appended [MASK]


def plant_payload(src, dst, marker) -> str:
    """A copy of the export `src` whose python files, and a tokenizer module its tokenizer_config.json
    maps AutoTokenizer to, create `marker`.<module> when imported."""
    shutil.copytree(src, dst)
    payload = f"\nopen({str(marker)!r} + '.' + __name__.rsplit('.', 1)[-1], 'w').write('ran')\n"
    shipped = [name for name in os.listdir(dst) if name.endswith(".py")]
    assert {"modeling_dllm.py", "configuration_dllm.py", "hf_generation.py", "mdlm.py"} <= set(shipped)
    for name in shipped:
        with open(os.path.join(dst, name), "a") as f:
            f.write(payload)
    with open(os.path.join(dst, "tokenization_dllm.py"), "w") as f:
        f.write(f"from transformers import LlamaTokenizer\n{payload}\n\nclass DLLMTokenizer(LlamaTokenizer):\n"
                f"    pass\n")
    path = os.path.join(dst, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_dllm.DLLMTokenizer"]}
    with open(path, "w") as f:
        json.dump(config, f)
    return str(dst)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{family: clean export} for ar and mdlm, the tokenizer, and a small validation dataset
    tokenized for its vocabulary."""
    root = tmp_path_factory.mktemp("exports")
    tok = train_sentencepiece(root / "tok.model", VOCAB - 1)
    out = {"tokenizer": tok}
    for family in ("ar", "mdlm"):
        ckpt = save_lightning(random_paper_model(family, seed=12, vocab=VOCAB), family, root / f"{family}.ckpt")
        clean = root / f"{family}-clean"
        assert convert_from_ref.main(["--ref", ckpt, "--tokenizer-type", "SentencePieceTokenizer",
                                      "--tokenizer-model", tok, "--hf-out", str(clean)]) == 0
        out[family] = str(clean)
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    data = str(root / "valid_text_document")
    builder = IndexedDatasetBuilder(data + ".bin", dtype=np.int32)
    gen = torch.Generator().manual_seed(0)
    for _ in range(16):
        doc = torch.randint(3, VOCAB - 1, (40,), generator=gen, dtype=torch.int32)
        builder.add_document(doc, [len(doc)])
    builder.finalize(data + ".idx")
    out["data"] = data
    return out


@pytest.fixture
def both(exports, tmp_path):
    """{family: (clean export, a fresh copy with payloads)}: a copy of its own per test, so that no
    module imported by an earlier test hides a payload."""
    return {family: (exports[family], plant_payload(exports[family], tmp_path / f"{family}-edited",
                                                    tmp_path / "payload-ran")) for family in ("ar", "mdlm")}


def no_payload_ran(tmp_path):
    ran = [p.name for p in tmp_path.glob("payload-ran*")]
    assert not ran, f"code of the export ran: {ran}"
    return True


def test_sample(both, tmp_path):
    from megatron_dllm.cli import sample

    results = []
    for which in both["mdlm"]:
        out = str(tmp_path / f"{len(results)}.json")
        assert sample.main(["--load", which, "--num-samples", "2", "--steps", "4", "--output", out]) == 0
        with open(out) as f:
            results.append(json.load(f))
    assert no_payload_ran(tmp_path)
    clean, edited = results
    assert clean["texts"] == edited["texts"] and clean["texts"]


def test_evaluate_nelbo_and_gen_ppl_with_the_exported_judge(exports, both, tmp_path):
    from megatron_dllm.cli import evaluate

    def run(argv, name):
        path = str(tmp_path / name)
        assert evaluate.main([*argv, "--output", path]) == 0
        with open(path) as f:
            return json.load(f)

    data = ["--data-path", exports["data"], "--split", "0,1,0", "--data-cache-path", str(tmp_path / "cache"),
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", exports["tokenizer"],
            "--global-batch-size", "4", "--eval-iters", "1"]
    nelbo = [run(["nelbo", "--load", which, *data], f"nelbo{i}.json")["nelbo"]
             for i, which in enumerate(both["mdlm"])]
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["The checkpoint is verified.",
                                                                        "Export it to Hugging Face."]))
    ppl = [run(["gen-ppl", "--samples", str(samples), "--judge", judge], f"ppl{i}.json")["gen_ppl"]
           for i, judge in enumerate(both["ar"])]
    assert no_payload_ran(tmp_path)
    assert nelbo[0] == nelbo[1] and np.isfinite(nelbo[0])
    assert ppl[0] == ppl[1] and np.isfinite(ppl[0])


def test_generate_of_the_loaded_model(both, tmp_path):
    from megatron_dllm.hf.load_export import load_model

    results = [load_model(which).generate(num_return_sequences=2, max_new_tokens=8, steps=4, seed=1)
               for which in both["mdlm"]]
    assert no_payload_ran(tmp_path)
    assert torch.equal(results[0], results[1])


def test_judge_loads_the_export_with_the_project_classes(both, tmp_path):
    from megatron_dllm.evaluation.judge import load_judge
    from megatron_dllm.hf.modeling_dllm import DLLMForCausalLM

    judge = load_judge(both["ar"][1])
    assert no_payload_ran(tmp_path)
    assert type(judge.model) is DLLMForCausalLM and judge.suppress_ids == [VOCAB - 1]


def test_convert_from_hf(both, tmp_path):
    from megatron_dllm import platform
    from megatron_dllm.cli import convert_from_hf
    from megatron_dllm.hf import export

    states = []
    try:
        for i, which in enumerate(both["mdlm"]):
            save = str(tmp_path / f"ckpt{i}")
            assert convert_from_hf.main(["--hf", which, "--save", save]) == 0
            model = export.load_megatron_model(save)[0]
            states.append({k: v.clone() for k, v in model.state_dict().items() if "_extra_state" not in k})
    finally:
        platform.destroy_distributed()
    assert no_payload_ran(tmp_path)
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_lm_eval_model(both, tmp_path):
    from megatron_dllm import platform
    from megatron_dllm.evaluation.lm_eval_model import MegatronDLLM

    requests = [("The checkpoint", " is verified."), ("Export it", " to Hugging Face.")]
    try:
        got = []
        for which in both["ar"]:
            lm = MegatronDLLM(load=which, batch_size=2)
            got.append([lm._loglikelihood_tokens([((c, x), lm.tok_encode(c), lm.tok_encode(x))])[0][0]
                        for c, x in requests])
    finally:
        platform.destroy_distributed()
    assert no_payload_ran(tmp_path)
    assert got[0] == got[1] and all(np.isfinite(got[0]))


def test_tokenizer_is_the_one_transformers_auto_class_loads(exports):
    """The tokenizer the tools load equals what a user's AutoTokenizer loads from the export."""
    from transformers import AutoTokenizer

    from megatron_dllm.hf.load_export import load_tokenizer

    ours, auto = load_tokenizer(exports["mdlm"]), AutoTokenizer.from_pretrained(exports["mdlm"])
    assert type(ours) is type(auto) and ours.mask_token_id == auto.mask_token_id == VOCAB - 1
    text = "Checkpoints of the paper's code import here: [MASK] and all."
    assert ours.encode(text) == auto.encode(text) and len(ours) == len(auto) == VOCAB
