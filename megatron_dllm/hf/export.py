"""Conversion between megatron_dllm checkpoints (torch_dist, any TP/PP layout) and Hugging Face
directories (config.json + model.safetensors + the self-contained modeling files + tokenizer).

The one converter between megatron's TP=1/PP=1 state dict (global layer numbers) and the dense
model's (modeling_dllm.py): HF keys are "backbone." + the dense DiT's parameter names; the fused
qkv rows are [3, heads, head_dim] in HF and [heads, 3, head_dim] in megatron. HF drops megatron's
vocabulary padding (real vocab incl. [MASK]) unless asked to keep it. Export, import, sampling's
loading and the tests all convert through it.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import sys
import tempfile

import torch

from megatron_dllm.checkpoint import layout
from megatron_dllm.checkpoint.identity import ModelIdentity
from megatron_dllm.checkpoint.meta import CheckpointMeta
from megatron_dllm.errors import InputError
from megatron_dllm.families import FAMILIES
from megatron_dllm.families.schedules import LogLinear
from megatron_dllm.hf.remote_code import remote_code_files
from megatron_dllm.model import constants

DEFAULT_SEQ_LENGTH = 2048
SENTENCEPIECE_MODEL = "tokenizer.model"  # an export's copy of its SentencePiece model

# megatron (TP=1, PP=1 DiTModel.state_dict()) -> HF suffix after "backbone."
_RENAMES = [("time_embedder.mlp.", "sigma_map.mlp."),
            ("embedding.word_embeddings.weight", "vocab_embed.weight"),
            ("final_layer.norm.", "output_layer.norm_final."),
            ("final_layer.adaLN_modulation.linear.", "output_layer.adaLN_modulation."),
            ("final_layer.output_layer.", "output_layer.linear."), ("layers.", "blocks."),
            ("input_layernorm.", "norm1."), ("pre_mlp_layernorm.", "norm2."),
            ("adaLN_modulation.linear.", "adaLN_modulation."),
            ("self_attention.linear_qkv.", "attn_qkv."), ("self_attention.linear_proj.", "attn_out."),
            ("mlp.linear_fc1.", "mlp.0."), ("mlp.linear_fc2.", "mlp.2.")]
_VOCAB_KEYS = ("vocab_embed.weight", "output_layer.linear.weight", "output_layer.linear.bias")


def _qkv(value: torch.Tensor, heads: int, to_hf: bool) -> torch.Tensor:
    three_d, d = value.shape
    dh = three_d // 3 // heads
    shape = (heads, 3, dh, d) if to_hf else (3, heads, dh, d)
    return value.reshape(shape).transpose(0, 1).reshape(three_d, d).contiguous()


def megatron_name_to_hf(key: str) -> str:
    for old, rep in _RENAMES:
        key = key.replace(old, rep)
    return "backbone." + key


def megatron_to_hf(state_dict: dict, num_heads: int, vocab_size: int) -> dict:
    """TP=1/PP=1 DiTModel state dict (global layer numbers), or a dict of its gradients under the
    same names -> HF state dict (fp32, CPU) with the first `vocab_size` vocabulary rows."""
    out = {}
    for key, value in state_dict.items():
        if "_extra_state" in key or value is None:
            continue
        new = megatron_name_to_hf(key)
        value = value.detach().float().cpu()
        if new.endswith("attn_qkv.weight"):
            value = _qkv(value, num_heads, to_hf=True)
        if new[len("backbone."):] in _VOCAB_KEYS:
            value = value[:vocab_size]
        out[new] = value.contiguous().clone()
    return out


def hf_to_megatron_tensor(hf_state: dict, megatron_key: str, num_heads: int, padded_vocab_size: int):
    """The full (TP=1) megatron tensor `megatron_key` (global layer number) from an HF state dict:
    qkv rows back to [heads, 3, head_dim], the vocabulary zero-padded to `padded_vocab_size`."""
    key = megatron_name_to_hf(megatron_key)
    if key not in hf_state:
        raise InputError(f"tensor {key} (megatron {megatron_key}) is missing from the HF weights")
    value = hf_state[key]
    if key.endswith("attn_qkv.weight"):
        value = _qkv(value, num_heads, to_hf=False)
    if key[len("backbone."):] in _VOCAB_KEYS and value.shape[0] < padded_vocab_size:
        pad = value.new_zeros((padded_vocab_size - value.shape[0],) + tuple(value.shape[1:]))
        value = torch.cat([value, pad])
    return value


# ---------------------------------------------------------------------- megatron side


def _match_keys(model_keys, saved_keys, use_ema: bool, path: str) -> dict:
    """model key (TP1 DiTModel, prefix '') -> saved key. Model tensors are saved under their bare
    names (global layer numbers, the same for every PP/VPP layout) and the EMA copy under `ema.`."""
    import re

    pattern = re.compile(r"ema[\w.]*" if use_ema else r"model\d*")
    by_suffix = {}
    for saved in saved_keys:
        if "optimizer" in saved:
            continue
        parts = saved.split(".")
        if not use_ema:
            by_suffix.setdefault(saved, []).append(saved)
        for i in range(1, len(parts)):
            if pattern.fullmatch(".".join(parts[:i])):
                by_suffix.setdefault(".".join(parts[i:]), []).append(saved)
    if use_ema and not by_suffix:
        raise InputError(f"--use-ema: the checkpoint {path} holds no EMA weights (no 'ema' key); "
                         f"train with EMA enabled (--ema-decay) or drop --use-ema")
    mapping = {}
    for key in model_keys:
        found = by_suffix.get(key, [])
        if len(found) != 1:
            raise InputError(f"{path}: model tensor {key!r} found {len(found)} times in the checkpoint "
                             f"({found[:4]}); is it a megatron_dllm checkpoint of this architecture?")
        mapping[key] = found[0]
    return mapping


def load_megatron_model(load: str, use_ema: bool = False, seq_length: int | None = None,
                        ckpt_step: int | None = None):
    """Rebuild the TP=1/PP=1 DiTModel (or GPTBackbone) of the checkpoint `--load load [--ckpt-step N]` names
    (saved at any TP/PP/VPP layout; megatron reshards on load; verified against its manifest) in
    the current world (call platform.init_distributed(1, 1) first).
    Returns (model, identity, checkpoint metadata, arch)."""
    from megatron.core import dist_checkpointing

    from megatron_dllm import checkpoint
    from megatron_dllm.model.builder import build_model, transformer_config

    found = checkpoint.locate(load, ckpt_step)
    if found is None:
        raise checkpoint.CheckpointError(f"--load {load}: no checkpoint there (expected {checkpoint.TRACKER} "
                                         f"or iter_XXXXXXX directories, or a checkpoint directory itself)")
    path = found.path
    meta = CheckpointMeta.read(path)
    identity = meta.identity
    if identity.gpt is not None:  # the dense model and the export are Llama/Qwen2-shaped
        from megatron_dllm.hf.pretrained_ar import transformers_kind
        from megatron_dllm.model.gpt_shape import GPTShape

        transformers_kind(GPTShape.from_dict(identity.gpt), path)
    tensors = checkpoint.read(path, dist_checkpointing.load_tensors_metadata, path)
    emb = [k for k in tensors if k.endswith("embedding.word_embeddings.weight") and "optimizer" not in k
           and k.startswith("ema") == use_ema]
    if not emb:
        if use_ema:
            raise InputError(f"--use-ema: the checkpoint {path} holds no EMA weights (no 'ema' key); "
                             f"train with EMA enabled (--ema-decay) or drop --use-ema")
        raise InputError(f"{path}: no embedding tensor in the checkpoint")
    padded = int(tensors[emb[0]].global_shape[0])
    seq = seq_length or meta.seq_length or DEFAULT_SEQ_LENGTH
    arch = identity.architecture(seq, make_vocab_size_divisible_by=padded)
    config, mlp_config = transformer_config(arch)
    model = build_model(arch, config, mlp_config, seed=0)[0]
    sharded = {k: v for k, v in model.sharded_state_dict().items() if "_extra_state" not in k}
    if identity.gpt is None:
        mapping = _match_keys(list(sharded), list(tensors), use_ema, path)
        for key, ten in sharded.items():
            ten.key = mapping[key]
    else:  # megatron-core's GPT keys as saved (layers stacked along a leading axis); EMA under "ema."
        for ten in sharded.values():
            ten.key = ("ema." if use_ema else "") + ten.key
            if ten.key not in tensors:
                raise InputError(f"{path}: model tensor {ten.key!r} not in the checkpoint; is it a megatron_dllm "
                                 f"checkpoint of this architecture?")
    loaded = checkpoint.read(path, dist_checkpointing.load, sharded, path)  # also returns the common state
    state = {k: loaded[k] for k in sharded}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any("_extra_state" not in k for k in missing):
        raise InputError(f"{path}: missing {missing}, unexpected {unexpected}")
    model.eval()
    return model, identity, meta, arch


def save_megatron_checkpoint(save: str, model, identity: ModelIdentity, iteration: int = 0,
                             seq_length: int | None = None, tokenizer=None):
    """Model-only checkpoint in our layout: SAVE/iter_XXXXXXX + latest_checkpointed_iteration.txt;
    `tokenizer`: the `TokenizerRecord` of the tokenizer it comes with, if any."""
    from megatron_dllm import checkpoint

    meta = CheckpointMeta(iteration, identity, seq_length=seq_length, tokenizer=tokenizer)
    return checkpoint.save(save, iteration, {"model": model.sharded_state_dict(), **meta.to_dict()})


# ---------------------------------------------------------------------- HF side


def hf_config_dict(identity: ModelIdentity, attention: str, max_length: int) -> dict:
    causal_lm = FAMILIES[identity.family].next_token
    arch_name = model_class_name(identity.family)
    auto = {"AutoConfig": "configuration_dllm.DLLMConfig", "AutoModel": f"modeling_dllm.{arch_name}",
            ("AutoModelForCausalLM" if causal_lm else "AutoModelForMaskedLM"): f"modeling_dllm.{arch_name}"}
    dit = {"cond_dim": constants.COND_DIM, "time_freq_dim": constants.TIME_FREQ_DIM,
           "time_max_period": constants.TIME_MAX_PERIOD, "rope_theta": constants.ROTARY_BASE,
           "layer_norm_eps": constants.LAYER_NORM_EPS}  # the GPT backbone's own sizes are in its `gpt` field
    return {"model_type": "dllm", "architectures": [arch_name], "auto_map": auto,
            **identity.hf_config_fields(), **({} if identity.gpt else dit),
            "noise_schedule": LogLinear.name, "noise_eps": constants.T_EPS, "attention": attention,
            "max_position_embeddings": int(max_length), "tie_word_embeddings": False,
            "use_cache": False, "torch_dtype": "float32"}


def model_class_name(family: str) -> str:
    """The transformers class of a family: DLLMForCausalLM for next-token models, else DLLMForMaskedLM."""
    return "DLLMForCausalLM" if FAMILIES[family].next_token else "DLLMForMaskedLM"


def model_class(family: str):
    """The class `model_class_name` names (imported here: modeling_dllm needs transformers)."""
    from megatron_dllm.hf import modeling_dllm

    return getattr(modeling_dllm, model_class_name(family))


def hf_model(state_dict: dict, identity: ModelIdentity, attention: str, max_length: int, vocab_size: int | None = None):
    """The transformers model holding a TP=1/PP=1 DiTModel state dict (fp32, CPU): what an export
    of it loads as. It keeps `vocab_size` vocabulary rows: the real vocabulary by default; megatron's
    padded size keeps the padding, so that its logits line up with megatron's column for column."""
    from megatron_dllm.hf.configuration_dllm import DLLMConfig

    config = hf_config_dict(identity, attention, max_length)
    for key in ("auto_map", "architectures", "model_type"):  # config.json's, not DLLMConfig's arguments
        del config[key]
    config["vocab_size"] = vocab_size or identity.vocab_size
    model = model_class(identity.family)(DLLMConfig(**config))
    model.load_state_dict(hf_state(state_dict, identity, config["vocab_size"]), strict=True)
    return model


def hf_state(state_dict: dict, identity: ModelIdentity, vocab_size: int | None = None) -> dict:
    """A TP=1/PP=1 megatron state dict of either backbone -> the dense model's (modeling_dllm.py)
    state dict with `vocab_size` (default: the real) vocabulary rows."""
    if identity.gpt is not None:
        from megatron_dllm.hf import export_gpt

        return export_gpt.dense_state(state_dict, identity, vocab_size)
    return megatron_to_hf(state_dict, identity.num_attention_heads, vocab_size or identity.vocab_size)


def write_hf_dir(out: str, hf_state: dict, config: dict) -> None:
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    save_file({k: v.contiguous() for k, v in sorted(hf_state.items())}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    for name, source in remote_code_files().items():  # the model and its generation code
        shutil.copyfile(source, os.path.join(out, name))
    if FAMILIES[config["family"]].next_token:  # generate() defaults
        gen = {"use_cache": False, "do_sample": False}
        with open(os.path.join(out, "generation_config.json"), "w") as f:
            json.dump(gen, f, indent=2)


def write_model_dir(out: str, state_dict: dict, identity: ModelIdentity, attention: str, max_length: int) -> int:
    """The model files of an export of a TP=1/PP=1 state dict; returns the number of tensors. A
    GPT-backbone AR model is written as transformers' own Llama/Qwen2 (no remote code); every other
    model as this project's remote code (config.json naming modeling_dllm's classes)."""
    if identity.gpt is not None and FAMILIES[identity.family].next_token:
        from megatron_dllm.hf import export_gpt

        return export_gpt.write_transformers_dir(out, state_dict, identity, max_length)
    weights = hf_state(state_dict, identity)
    write_hf_dir(out, weights, hf_config_dict(identity, attention, max_length))
    return len(weights)


def check_export_target(out: str, flag: str, overwrite: bool, source: str) -> None:
    """An export may replace only an earlier export (with `overwrite`), and never the checkpoint
    it reads (`source`), a directory holding it or one inside it."""
    out_real, source_real = os.path.realpath(out), os.path.realpath(source)
    if os.path.commonpath([out_real, source_real]) in (out_real, source_real):
        raise InputError(f"{flag} {out} overlaps the checkpoint it converts ({source}); choose another directory")
    if not os.path.lexists(out):
        return
    if not overwrite:
        raise InputError(f"{flag} {out} already exists; pass --overwrite to replace it")
    if not os.path.isdir(out):
        raise InputError(f"{flag} {out} is a file; --overwrite replaces only an earlier export (a directory)")
    if os.listdir(out) and not os.path.isfile(os.path.join(out, "config.json")):
        raise InputError(f"{flag} {out} is not a Hugging Face export (no config.json); --overwrite replaces "
                         f"only an earlier export")


@contextlib.contextmanager
def staged_export(out: str):
    """Yield a directory beside `out` to write an export into. When the block completes it becomes
    `out` (replacing an earlier export whole), world-readable; on an error it is removed, so a
    partial export never stands under the final name. The caller holds `out`'s lock: staging
    directories a killed export left beside it are removed first."""
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    prefix = os.path.basename(out) + ".incomplete-"
    for stale in glob.glob(os.path.join(glob.escape(parent), glob.escape(prefix) + "*")):
        shutil.rmtree(stale, ignore_errors=True)
    layout.recover_replaced(out)  # an earlier export a killed --overwrite had moved aside
    staging = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        yield staging
        for base, _dirs, files in os.walk(staging):  # mkdtemp and safetensors make them private
            os.chmod(base, 0o755)
            for name in files:
                os.chmod(os.path.join(base, name), 0o644)
        layout.publish(staging, out)
    except Exception as err:  # safetensors' and tokenizers' (Rust) write errors are no OSError
        code = re.search(r"\(os error (\d+)\)", str(err)) if not isinstance(err, OSError) else None
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), out) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already when published


# text that a SentencePiece normalizer (nmt_nfkc, whitespace collapsing) changes
NORMALIZATION_PROBE = "word  word\tand\nline \ufb01ne caf\u00e9\u3000end"


def _chat_template(directory: str, config: dict) -> str | dict | None:
    """A HuggingFace tokenizer's chat template: chat_template.jinja (transformers 5) or
    tokenizer_config.json's chat_template (4); None without one."""
    path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    return config.get("chat_template")


def _sentencepiece_unigram(model_path: str) -> bool:
    """Whether a SentencePiece model is a unigram one (SentencePiece's default type), which the Llama
    conversion would turn into a BPE of other segmentations."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    with open(model_path, "rb") as f:
        proto.ParseFromString(f.read())
    return proto.trainer_spec.model_type == sentencepiece_model_pb2.TrainerSpec.UNIGRAM


def _unigram_tokenizer(model_path: str):
    """A `tokenizers` Unigram of the model's pieces and scores, with its normalizer and pre-tokenizer
    (transformers' generic SentencePiece conversion), adding no special token to the text."""
    from types import SimpleNamespace

    from transformers.convert_slow_tokenizer import SpmConverter

    return SpmConverter(SimpleNamespace(vocab_file=model_path, legacy=True, add_prefix_space=True)).converted()


def export_tokenizer(out: str, tokenizer_type: str, tokenizer_model: str, vocab_size: int, mask_id: int,
                     options: dict | None = None) -> None:
    """Write a tokenizer that `AutoTokenizer.from_pretrained(out)` loads offline, with [MASK] at
    `mask_id` (checked against the model's vocabulary). `options`: TikTokenizer's
    (`TokenizerConfig.options()`)."""
    from megatron_dllm.data.tokenizers import build_tokenizer

    ours = build_tokenizer(tokenizer_type, tokenizer_model, **(options or {}))
    if (ours.vocab_size, ours.mask_id) != (vocab_size, mask_id):
        raise InputError(f"--tokenizer-model {tokenizer_model}: vocab_size {ours.vocab_size} / mask id "
                         f"{ours.mask_id} do not match the checkpoint's {vocab_size} / {mask_id}")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    with tempfile.TemporaryDirectory() as tmp:
        if tokenizer_type == "SentencePieceTokenizer" and _sentencepiece_unigram(ours.model_path):
            tok = PreTrainedTokenizerFast(tokenizer_object=_unigram_tokenizer(ours.model_path),
                                          eos_token=ours._sp.id_to_piece(ours.eod),
                                          unk_token=ours._sp.id_to_piece(ours._sp.unk_id()))
        elif tokenizer_type == "SentencePieceTokenizer":  # BPE: transformers' Llama conversion
            shutil.copyfile(ours.model_path, os.path.join(tmp, SENTENCEPIECE_MODEL))
            with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
                json.dump({"tokenizer_class": "LlamaTokenizer", "add_bos_token": False,
                           "add_eos_token": False, "legacy": True}, f)
            tok = AutoTokenizer.from_pretrained(tmp)
        elif tokenizer_type == "HuggingFaceTokenizer":
            cfg = ours._read_config(os.path.dirname(ours.model_path))
            tok = PreTrainedTokenizerFast(tokenizer_file=ours.model_path,
                                          eos_token=ours._tok.id_to_token(ours.eod),
                                          bos_token=None if ours.bos is None else ours._tok.id_to_token(ours.bos),
                                          **{k: cfg[k] for k in ("unk_token", "pad_token") if k in cfg})
            tok.chat_template = _chat_template(os.path.dirname(ours.model_path), cfg)  # an instruct model's
            # a post-processor that adds a BOS (Llama's, TinyLlama's) would put before every text a
            # token training never saw: training encodes without special tokens
            from tokenizers.processors import TemplateProcessing

            tok.backend_tokenizer.post_processor = TemplateProcessing(single="$A", pair="$A $B")
        else:  # TikTokenizer: .tiktoken or Megatron-LM's JSON vocabulary
            from megatron_dllm.hf.tiktoken_tokenizer import hf_tokenizer_from_tiktoken

            names = {i: t for t, i in ours._enc._special_tokens.items()}
            tok = PreTrainedTokenizerFast(tokenizer_object=hf_tokenizer_from_tiktoken(ours._enc),
                                          eos_token=names[ours.eod],
                                          bos_token=None if ours.bos is None else names[ours.bos],
                                          **{k: t for k, t in (("unk_token", "<unk>"), ("pad_token", "<pad>"))
                                             if t in ours._enc._special_tokens})
        mask_piece = "[MASK]" if ours.mask_appended else None
        if mask_piece is None:
            mask_piece = tok.convert_ids_to_tokens(mask_id)
        tok.add_special_tokens({"mask_token": mask_piece})
        if tok.mask_token_id != mask_id:
            raise InputError(f"exported tokenizer maps {mask_piece} to {tok.mask_token_id}, expected {mask_id}")
        # a special token's string in a document is text, as training encoded it (SentencePiece, .tiktoken)
        tok.split_special_tokens = tok.init_kwargs["split_special_tokens"] = not ours.special_tokens_in_text
        if ours.tokenize(NORMALIZATION_PROBE) != tok.encode(NORMALIZATION_PROBE, add_special_tokens=False):
            print(f"note: the exported tokenizer encodes some text to other ids than {tokenizer_model} does (runs "
                  f"of whitespace, tabs, newlines or compatibility characters: transformers' conversion drops "
                  f"its normalizer); the model's generations decode alike, but scoring text with the export "
                  f"may differ from training", file=sys.stderr)
        if tok.pad_token is None:  # batches pad with EOS, as SFT rows do (the attention mask hides it)
            tok.pad_token = tok.eos_token
        # a document starts right after an EOD in the training data, never after a BOS: what a
        # consumer prefixes as BOS (lm-eval's hf backend, to empty contexts and rolling windows)
        tok.bos_token = tok.eos_token
        if os.path.isfile(os.path.join(out, "config.json")):  # the model's context, not "unlimited"
            tok.model_max_length = _read_json(os.path.join(out, "config.json"))["max_position_embeddings"]
        tok.save_pretrained(out)
    if tokenizer_type == "SentencePieceTokenizer":  # the original beside the conversion (transformers writes none)
        shutil.copyfile(ours.model_path, os.path.join(out, SENTENCEPIECE_MODEL))
    # the model's generate stops at the tokenizer's EOS without being told it. No pad id: the EOS is
    # a real input token (a document's start), and transformers' generate, given another eos_token_id,
    # would take every token equal to a pad id for padding (it pads finished rows with the EOS instead)
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(out, name)
        if os.path.isfile(path):
            config = _read_json(path)
            config.update(eos_token_id=ours.eod, pad_token_id=None, bos_token_id=tok.bos_token_id)
            with open(path, "w") as f:
                json.dump(config, f, indent=2, sort_keys=True)


def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)
