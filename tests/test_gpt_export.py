"""Hugging Face export, re-import and sampling of the GPT (Llama-style) backbone, in process on
random-weight models that transformers itself builds (tests/test_gpt_backbone.py's `tiny_hf`),
imported as megatron checkpoints with tools/convert_from_hf.py:

- family ar exports as transformers' own LlamaForCausalLM / Qwen2ForCausalLM (no remote code) and
  the diffusion families as modeling_dllm's dense GPT (remote code with `generate`); both give the
  megatron model's logits (fp32, 1e-5 relative), Eso-LM at permuted positions, BD3-LM on its
  [x_t ; x_0] input under the block mask;
- convert_from_hf.py on the export gives back the same megatron tensors, bit for bit;
- the checkpoint's tokenizer travels with the export and back;
- an export's `generate` and tools/sample.py on the megatron checkpoint draw the same samples.
"""
import json
import os

import pytest
import torch
from test_gpt_backbone import tiny_hf

V = 101  # tiny_hf's 100 rows + the appended [MASK]
CASES = [("llama", "ar"), ("qwen2", "ar"), ("llama", "mdlm"), ("qwen2", "duo"), ("llama", "esolm"),
         ("qwen2", "bd3lm")]


CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} </s> {% endfor %}"


def _import(kind: str, family: str, root, tokenizer: bool = False) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from megatron_dllm.cli import convert_from_hf

    hf = tiny_hf(kind, root)
    if family == "bd3lm":  # not an import target: the same tensors written as a BD3-LM checkpoint
        return _gpt_checkpoint(hf, str(root / f"{kind}-{family}"), family, block_size=4)
    if tokenizer:  # a word-level tokenizer of the model's 100 rows, EOS last
        vocab = {f"w{i}": i for i in range(99)} | {"</s>": 99}
        words = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
        words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        words.save(os.path.join(hf, "tokenizer.json"))
        with open(os.path.join(hf, "tokenizer_config.json"), "w") as f:
            json.dump({"eos_token": "</s>"}, f)
        with open(os.path.join(hf, "chat_template.jinja"), "w") as f:  # where transformers 5 saves it
            f.write(CHAT_TEMPLATE)
    save = str(root / f"{kind}-{family}")
    assert convert_from_hf.main(["--hf", hf, "--save", save, "--family", family, "--seq-length", "16"]) == 0
    return save


def _gpt_checkpoint(hf: str, save: str, family: str, record=None, **options) -> str:
    """The imported tensors written as a checkpoint of `family` with its `options` (what a run with
    those flags saves: BD3-LM's blocks, MDLM's --shift)."""
    from types import SimpleNamespace

    from megatron_dllm.checkpoint.identity import ModelIdentity
    from megatron_dllm.families import get_family
    from megatron_dllm.hf import pretrained_ar
    from megatron_dllm.hf.import_ar import write_gpt_checkpoint
    from megatron_dllm.model.builder import Architecture

    preset, shape, rows = pretrained_ar.shape_of(pretrained_ar.read_config(hf), hf)
    whole = pretrained_ar.to_megatron(pretrained_ar.read_weights(hf), preset, shape, hf)
    fam = get_family(family, V - 1, V, **options)
    arch = Architecture(preset, V, 16, fam.attention, 128, gpt=shape)
    identity = ModelIdentity.of(fam, arch)
    args = SimpleNamespace(save=save, tensor_model_parallel_size=1, pipeline_model_parallel_size=1, iteration=0,
                           overwrite=False)
    write_gpt_checkpoint(whole, identity, arch, args, record, hf)
    return save


def test_an_export_takes_the_tokenizer_recorded_as_a_directory(tmp_path, world_of_one):
    """A run given --tokenizer-model DIR (the import's tokenizer directory, as the docs' recipe
    does) records the directory; the export without tokenizer flags takes it from there."""
    from transformers import AutoTokenizer

    from megatron_dllm.checkpoint.tokenizer_record import TokenizerRecord
    from megatron_dllm.cli import convert_to_hf
    from megatron_dllm.config.data import TokenizerConfig

    directory = os.path.join(_import("llama", "mdlm", tmp_path, tokenizer=True), "tokenizer")
    record = TokenizerRecord.of(TokenizerConfig.from_options("HuggingFaceTokenizer", directory, None))
    assert record.model == directory
    save = _gpt_checkpoint(tiny_hf("llama", tmp_path), str(tmp_path / "trained"), "mdlm", record=record)
    out = str(tmp_path / "hf")
    assert convert_to_hf.main(["--load", save, "--out", out]) == 0
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.encode("w3 w7 </s>", add_special_tokens=False) == [3, 7, 99] and tok.mask_token_id == V - 1


def _megatron_tensors(path: str) -> dict:
    from megatron_dllm.hf import export

    model, identity, _, _ = export.load_megatron_model(path)
    return {k: v for k, v in model.state_dict().items() if "_extra_state" not in k}, model, identity


@pytest.mark.parametrize("kind,family", CASES)
def test_export_equals_megatron_and_reimports_exactly(kind, family, tmp_path, world_of_one, capsys):
    import transformers

    from megatron_dllm.cli import convert_from_hf, convert_to_hf

    ckpt = _import(kind, family, tmp_path)
    out = str(tmp_path / "hf")
    assert convert_to_hf.main(["--load", ckpt, "--out", out]) == 0
    tensors, model, identity = _megatron_tensors(ckpt)
    files = set(os.listdir(out))
    if family == "ar":  # transformers' own architecture, no python file shipped
        assert files == {"config.json", "model.safetensors"}
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert type(hf).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[kind]
        assert hf.config.mask_token_id == identity.mask_id
    else:
        assert {"modeling_dllm.py", "hf_generation.py"} <= files
        hf = transformers.AutoModelForMaskedLM.from_pretrained(out, trust_remote_code=True,
                                                               dtype=torch.float32).eval()
        assert hf.config.family == family and hf.config.gpt == identity.gpt
    assert hf.config.vocab_size == V
    gen = torch.Generator().manual_seed(1)
    b, s = 3, 16
    ids = torch.randint(0, V, (b, s), generator=gen)
    pos = torch.arange(s).expand(b, s)
    mask = attend = None
    if family == "esolm":  # the shuffled order at the original positions, causal over that order
        pos = torch.stack([torch.randperm(s, generator=gen) for _ in range(b)])
    if family == "bd3lm":  # the training input [x_t ; x_0] under BD3-LM's block mask
        from megatron_dllm.families import get_family

        noised = torch.where(torch.rand(b, s, generator=gen) < 0.5, V - 1, ids)
        inp = get_family("bd3lm", V - 1, V, **identity.family_options).model_input(ids, noised, torch.full((b,), 0.5))
        ids, pos, mask, attend = inp.input_ids, inp.position_ids, inp.attention_mask, inp.attend()
    with torch.no_grad():
        ref = model(ids, pos, torch.full((b,), 0.7), mask).transpose(0, 1)[..., :V]
        got = hf(input_ids=ids, position_ids=pos, attention_mask=attend).logits
    assert ref.abs().max() > 0.5  # not a degenerate comparison
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5

    back = str(tmp_path / "back")
    assert convert_from_hf.main(["--hf", out, "--save", back]) == 0
    again, _, identity_again = _megatron_tensors(back)
    assert identity_again == identity
    assert sorted(again) == sorted(tensors)
    for name, value in tensors.items():
        assert torch.equal(again[name], value), name
    capsys.readouterr()


def test_tokenizer_travels_with_the_export(tmp_path, world_of_one):
    """The imported tokenizer.json (with [MASK] appended) is exported by default and imported back
    with the same vocabulary and [MASK]."""
    import transformers
    from megatron.core import dist_checkpointing

    from megatron_dllm.checkpoint import locate
    from megatron_dllm.cli import convert_from_hf, convert_to_hf

    ckpt = _import("llama", "ar", tmp_path, tokenizer=True)
    out = str(tmp_path / "hf")
    assert convert_to_hf.main(["--load", ckpt, "--out", out]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (tok.mask_token, tok.mask_token_id, len(tok)) == ("[MASK]", V - 1, V)
    assert tok.encode("w3 w7 </s>", add_special_tokens=False) == [3, 7, 99]
    # an instruct model's chat template survives the import and the export
    assert tok.apply_chat_template([{"role": "user", "content": "w3 w7"}], tokenize=False) == "w3 w7 </s> "
    # generate stops at the tokenizer's EOS, not at LlamaConfig's default ids 1 and 2
    generation = transformers.AutoModelForCausalLM.from_pretrained(out).generation_config
    assert (generation.eos_token_id, generation.bos_token_id, tok.bos_token_id) == (99, 99, 99)
    back = str(tmp_path / "back")
    assert convert_from_hf.main(["--hf", out, "--save", back]) == 0
    identity = dist_checkpointing.load_common_state_dict(locate(back, None).path)["identity"]
    assert (identity["vocab_size"], identity["mask_id"]) == (V, V - 1)


def test_generate_and_sample_command_draw_the_same_samples(tmp_path, world_of_one):
    """An MDLM export's `generate` (remote code) equals megatron_dllm's sampler on the megatron
    checkpoint; tools/sample.py runs on MDLM, AR and BD3-LM checkpoints, its KV caches change no
    sample, and on the AR export (transformers' Qwen2 directory) it draws the checkpoint's samples."""
    import transformers

    from megatron_dllm.cli import convert_to_hf, sample
    from megatron_dllm.sampling import SamplingConfig, generate, load_inference_model

    ckpt = _import("llama", "mdlm", tmp_path)
    out = str(tmp_path / "hf")
    assert convert_to_hf.main(["--load", ckpt, "--out", out]) == 0
    hf = transformers.AutoModelForMaskedLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    got = hf.generate(num_return_sequences=3, max_new_tokens=12, steps=6, seed=0)
    inf = load_inference_model(ckpt)
    want = generate(inf, SamplingConfig(steps=6, seq_length=12), num_samples=3, seed=0)
    assert torch.equal(got.cpu(), want.cpu())
    assert not (want == inf.mask_id).any() and len(set(want.flatten().tolist())) > 3

    ar = _import("qwen2", "ar", tmp_path, tokenizer=True)  # AR samples start after its EOS
    ar_export = str(tmp_path / "hf-ar")  # transformers' Qwen2: sampled from its tensors alone
    assert convert_to_hf.main(["--load", ar, "--out", ar_export]) == 0
    bd3lm = _import("llama", "bd3lm", tmp_path)
    samples = {}
    for load, flags in ((ckpt, ()), (ar, ()), (ar_export, ()), (ar, ("--no-kv-cache",)), (bd3lm, ()),
                        (bd3lm, ("--no-kv-cache",))):
        record = tmp_path / f"samples{len(samples)}.json"
        assert sample.main(["--load", load, "--num-samples", "2", "--steps", "4", "--seq-length", "12",
                            "--device", "cpu", "--output", str(record), *flags]) == 0
        samples[load, flags] = torch.tensor(json.loads(record.read_text())["tokens"])
        assert samples[load, flags].shape == (2, 12) and not (samples[load, flags] == V - 1).any()
    assert torch.equal(samples[ar, ()], samples[ar_export, ()])
    for load in (ar, bd3lm):  # the KV caches (grouped-query heads, BD3-LM's blocks) change nothing
        assert torch.equal(samples[load, ()], samples[load, ("--no-kv-cache",)])


def test_a_shifted_mdlm_exports_its_shift_and_samples_with_it(tmp_path, world_of_one):
    """An AR model adapted to MDLM with --shift (a Llama's tensors saved as a shifted MDLM): the
    checkpoint and its export record the shift, the export's `generate` (transformers, remote code)
    equals megatron_dllm's sampler on the checkpoint, its greedy samples differ from the unshifted
    model's (greedy: the tiny Llama's logits are nearly uniform), and the export imports back with
    the shift."""
    import dataclasses

    import transformers

    from megatron_dllm.checkpoint.meta import CheckpointMeta
    from megatron_dllm.cli import convert_from_hf, convert_to_hf
    from megatron_dllm.sampling import SamplingConfig, generate, load_inference_model

    ckpt = _gpt_checkpoint(tiny_hf("llama", tmp_path), str(tmp_path / "shifted"), "mdlm", shift=True)
    out = str(tmp_path / "hf")
    assert convert_to_hf.main(["--load", ckpt, "--out", out]) == 0
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["family_options"] == {"shift": True}
    hf = transformers.AutoModelForMaskedLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    inf = load_inference_model(ckpt)
    greedy = {"sampler": "left-to-right", "top_p": 1e-9}  # the argmax: the near-uniform logits' differences show
    for kwargs in ({"steps": 6}, greedy):
        got = hf.generate(num_return_sequences=3, max_new_tokens=12, seed=0, **kwargs)
        cfg = SamplingConfig(seq_length=12, **{"predictor" if k == "sampler" else k: v for k, v in kwargs.items()})
        want = generate(inf, cfg, num_samples=3, seed=0)
        assert torch.equal(got.cpu(), want.cpu())
    unshifted = generate(dataclasses.replace(inf, family_options={}), cfg, num_samples=3, seed=0)
    assert not torch.equal(want, unshifted)
    again = str(tmp_path / "again")
    assert convert_from_hf.main(["--hf", out, "--save", again]) == 0
    assert CheckpointMeta.read(os.path.join(again, "iter_0000000")).identity.family_options == {"shift": True}


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_flops_and_parameters_of_the_gpt_backbone(kind, tmp_path, world_of_one):
    """The `full` FLOPs convention equals FlopCounterMode on a forward pass of the megatron model
    and of the exported dense model (GQA, SwiGLU; tied and untied); the parameter count equals
    transformers' own model's, and the released presets' counts are the published ones."""
    import transformers
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_dllm.cli import convert_to_hf
    from megatron_dllm.hf import export, load_export
    from megatron_dllm.model.params import count_parameters
    from megatron_dllm.model.presets import get_preset, gpt_shape_of
    from megatron_dllm.scaling.flops import forward_flops_per_sequence

    ckpt = _import(kind, "mdlm", tmp_path)
    model, identity, _, arch = export.load_megatron_model(ckpt)
    assert convert_to_hf.main(["--load", ckpt, "--out", str(tmp_path / "hf")]) == 0
    dense = load_export.load_model(str(tmp_path / "hf")).eval()
    b, s = 2, 16
    ids = torch.randint(0, V, (b, s))
    pos = torch.arange(s).expand(b, s)
    full = forward_flops_per_sequence(arch.preset, V, s, "full", arch.gpt)
    for name, forward in (("megatron", lambda: model(ids, pos, None)), ("dense", lambda: dense(input_ids=ids))):
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
            forward()
        padding = 2 * b * s * arch.preset.hidden_size * (arch.padded_vocab_size(1) - V) if name == "megatron" else 0
        assert counter.get_total_flops() == b * full + padding, name
    calflops = forward_flops_per_sequence(arch.preset, V, s, "calflops", arch.gpt)
    assert full - calflops == arch.preset.num_layers * 4 * s * s * arch.preset.hidden_size  # attention only

    reference = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / kind))  # tiny_hf's model
    counted = count_parameters(arch.preset, 100, arch.gpt)
    assert counted["params"] == reference.num_parameters()
    assert counted["non_embedding_params"] == reference.num_parameters() - 100 * arch.preset.hidden_size
    # SmolLM2-135M and Qwen2.5-0.5B as their model cards count them (vocabularies as released)
    assert count_parameters(get_preset("smollm2-135m"), 49152, gpt_shape_of("smollm2-135m"))["params"] == 134515008
    assert count_parameters(get_preset("qwen2.5-0.5b"), 151936, gpt_shape_of("qwen2.5-0.5b"))["params"] == 494032768


def test_shapes_that_are_not_llama_are_refused_in_one_line(tmp_path, world_of_one, capsys):
    """Megatron-LM's default GPT (LayerNorm, GELU, biases, learned positions) is neither a Llama nor a
    Qwen2: export, sampling and evaluation name what differs, in one line each."""
    from megatron_dllm.checkpoint.identity import ModelIdentity
    from megatron_dllm.cli import convert_to_hf, evaluate, sample
    from megatron_dllm.families import get_family
    from megatron_dllm.hf import export
    from megatron_dllm.model.builder import Architecture, build_model, transformer_config
    from megatron_dllm.model.gpt_shape import GPTShape
    from megatron_dllm.model.presets import Preset

    arch = Architecture(Preset(32, 1, 2), V, 16, "bidirectional", 128, gpt=GPTShape(ffn_hidden_size=64))
    config, _ = transformer_config(arch)
    model = build_model(arch, config, config, seed=0)[0]
    save = str(tmp_path / "gpt2-like")
    export.save_megatron_checkpoint(save, model, ModelIdentity.of(get_family("mdlm", V - 1, V), arch), 0, 16)
    capsys.readouterr()
    assert convert_to_hf.main(["--load", save, "--out", str(tmp_path / "hf")]) == 2
    assert sample.main(["--load", save, "--device", "cpu", "--output", str(tmp_path / "s.json")]) == 2
    assert evaluate.main(["nelbo", "--load", save, "--output", str(tmp_path / "e.json")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3
    for line in lines:
        assert line.startswith(f"error: {save}/iter_0000000: a --backbone gpt model with --normalization "
                               f"LayerNorm"), line
        assert "no --swiglu" in line and "learned_absolute" in line and "biases" in line
    assert not (tmp_path / "hf").exists()


def test_llama3_rope_scaling_exports_to_transformers(tmp_path, world_of_one):
    """A Llama-3.2-like shape (rope scaling x32, untied here) trained from scratch exports as a
    LlamaForCausalLM whose rope_scaling gives the megatron logits, at positions where the scaling
    changes the angles."""
    import dataclasses

    import transformers

    from megatron_dllm.checkpoint.identity import ModelIdentity
    from megatron_dllm.cli import convert_to_hf
    from megatron_dllm.families import get_family
    from megatron_dllm.hf import export
    from megatron_dllm.model.builder import Architecture, build_model, transformer_config
    from megatron_dllm.model.presets import Preset, gpt_shape_of

    shape = dataclasses.replace(gpt_shape_of("llama-3.2-1b"), ffn_hidden_size=96, num_query_groups=2,
                                untie_embeddings_and_output_weights=True)
    arch = Architecture(Preset(64, 2, 4), V, 16, "causal", 128, gpt=shape)
    config, _ = transformer_config(arch)
    model = build_model(arch, config, config, seed=3)[0].eval()
    with torch.no_grad():  # logits that differ from token to token
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 1.0)
    save, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    export.save_megatron_checkpoint(save, model, ModelIdentity.of(get_family("ar", V - 1, V), arch), 0, 16)
    assert convert_to_hf.main(["--load", save, "--out", out]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))
    pos = (torch.arange(16) + 20000).expand(2, 16)
    with torch.no_grad():
        ref = model(ids, pos, None).transpose(0, 1)[..., :V]
        got = hf(input_ids=ids, position_ids=pos).logits
        unscaled = dataclasses.replace(shape, rope_scaling_factor=None)
        model.rotary_pos_emb = type(model.rotary_pos_emb)(kv_channels=16, rotary_percent=1.0,
                                                          rotary_base=unscaled.rotary_base)
        plain = model(ids, pos, None).transpose(0, 1)[..., :V]
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5
    assert ((plain - ref).abs().max() / ref.abs().max()).item() > 1e-3  # the scaling matters here


def test_a_failed_import_over_a_checkpoint_leaves_its_tokenizer(tmp_path, world_of_one, monkeypatch, capsys):
    """The tokenizer is staged and put in place only once the new checkpoint is written: a failed
    --overwrite keeps the old checkpoint's tokenizer, a failed first import leaves none."""
    from megatron_dllm.cli import convert_from_hf
    from megatron_dllm.errors import InputError
    from megatron_dllm.hf import import_ar

    save = _import("llama", "mdlm", tmp_path, tokenizer=True)
    tokenizer = os.path.join(save, "tokenizer", "tokenizer.json")
    before = open(tokenizer).read()
    hf = tiny_hf("llama", tmp_path)
    with open(os.path.join(hf, "tokenizer.json"), "w") as f:  # another tokenizer in the new import
        f.write(before.replace('"w3"', '"x3"'))

    def fail(*args, **kwargs):
        raise InputError("--tensor-model-parallel-size: the write failed")

    monkeypatch.setattr(import_ar, "write_gpt_checkpoint", fail)
    assert convert_from_hf.main(["--hf", hf, "--save", save, "--family", "mdlm", "--overwrite"]) == 2
    assert open(tokenizer).read() == before and sorted(os.listdir(save)).count("tokenizer.staging") == 0
    fresh = str(tmp_path / "fresh")
    assert convert_from_hf.main(["--hf", hf, "--save", fresh, "--family", "mdlm"]) == 2
    assert not os.path.exists(os.path.join(fresh, "tokenizer"))
    assert "the write failed" in capsys.readouterr().err


def test_an_ar_exports_tools_read_its_shipped_sentencepiece_model(tmp_path, world_of_one, paragraphs):
    """transformers' conversion of a SentencePiece model drops a leading space's piece; the tools
    read the model an export of this project ships beside it, not a released model's own."""
    import shutil

    import sentencepiece as spm

    from megatron_dllm.cli import convert_to_hf
    from megatron_dllm.hf.export import SENTENCEPIECE_MODEL
    from megatron_dllm.sampling import load_inference_model

    out = str(tmp_path / "hf-ar")  # transformers' Llama: read by the tools from its tensors alone
    assert convert_to_hf.main(["--load", _import("llama", "ar", tmp_path, tokenizer=True), "--out", out]) == 0
    spm.SentencePieceTrainer.train(sentence_iterator=iter(paragraphs), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=V - 1, model_type="bpe", num_threads=1, minloglevel=2)
    shutil.copyfile(tmp_path / "sp.model", os.path.join(out, SENTENCEPIECE_MODEL))  # [MASK] appended: V ids
    assert load_inference_model(out).tokenizer.name == "SentencePieceTokenizer"
    config = json.loads((tmp_path / "hf-ar" / "config.json").read_text())
    del config["mask_token_id"]  # a released model's directory: its own tokenizer files
    (tmp_path / "hf-ar" / "config.json").write_text(json.dumps(config))
    assert getattr(load_inference_model(out).tokenizer, "name", None) != "SentencePieceTokenizer"
