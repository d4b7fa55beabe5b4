"""One inference model for sampling and evaluation, from a megatron checkpoint or an HF directory.

Both load into the exported plain-PyTorch model (`hf/modeling_dllm.py`): a megatron checkpoint
saved at any TP/PP layout is resharded to one device on load and converted in memory, exactly as
`tools/convert_to_hf.py` would write it. A transformers Llama/Qwen2 directory (the GPT backbone's
AR export, or a released model) loads as the same dense model with the GPT backbone. Sampling
and evaluation therefore run one code path, whatever the source.
"""
from __future__ import annotations

import os

import torch

from megatron_dllm.errors import InputError
from megatron_dllm.sampling.inference_model import InferenceModel


def _given_config(tokenizer_type, tokenizer_model, tokenizer_options):
    from megatron_dllm.config.data import TokenizerConfig

    if not (tokenizer_type and tokenizer_model):
        return None
    return TokenizerConfig.from_options(tokenizer_type, tokenizer_model, tokenizer_options)


def _from_megatron(path: str, use_ema: bool, tokenizer_type, tokenizer_model, tokenizer_options):
    from megatron.core import parallel_state

    from megatron_dllm import platform
    from megatron_dllm.checkpoint.tokenizer_record import recorded_tokenizer_config
    from megatron_dllm.hf import export

    if not parallel_state.model_parallel_is_initialized():
        platform.init_distributed(1, 1)
    megatron_model, identity, meta, arch = export.load_megatron_model(path, use_ema)
    model = export.hf_model(megatron_model.state_dict(), identity, arch.attention, arch.seq_length)
    given = _given_config(tokenizer_type, tokenizer_model, tokenizer_options)
    config = recorded_tokenizer_config(meta.tokenizer, given, path)
    return model, config


def _from_hf(path: str, tokenizer_type, tokenizer_model, tokenizer_options):
    from megatron_dllm.hf import export_gpt, load_export, pretrained_ar
    from megatron_dllm.hf.config_json import read_config_json
    from megatron_dllm.hf.export import SENTENCEPIECE_MODEL

    if pretrained_ar.is_pretrained_ar(path):  # transformers' Llama/Qwen2 (an AR export): only tensors are read
        model = export_gpt.dense_from_transformers_dir(path)
        ours = "mask_token_id" in read_config_json(os.path.join(path, "config.json"), "--load", dllm=False)
    else:
        read_config_json(os.path.join(path, "config.json"), "--load")  # its faults named, before transformers
        model, ours = load_export.load_model(path), True  # this project's classes: no python file of it runs
    original = os.path.join(path, SENTENCEPIECE_MODEL)
    if not tokenizer_model and ours and os.path.isfile(original):
        # the SentencePiece model an export ships beside its conversion, which drops a leading
        # space's piece and decodes byte pieces that form no character otherwise: texts equal the
        # checkpoint's
        tokenizer_type, tokenizer_model = "SentencePieceTokenizer", original
    return model, _given_config(tokenizer_type, tokenizer_model, tokenizer_options)


class HFDirTokenizer:
    """The tokenizer exported next to an HF model, behind megatron_dllm's tokenizer surface."""

    def __init__(self, path: str):
        from megatron_dllm.hf import load_export

        self._tok = load_export.load_tokenizer(path)
        self.mask_id = self._tok.mask_token_id
        self.eod = self._tok.eos_token_id
        self.bos = self._tok.bos_token_id
        self.vocab_size = len(self._tok)

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids if int(i) != self.mask_id])


def load_inference_model(path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                         use_ema: bool = False, tokenizer_type: str | None = None,
                         tokenizer_model: str | None = None, tokenizer_options: dict | None = None) -> InferenceModel:
    """`path` is a megatron checkpoint root (with latest_checkpointed_iteration.txt) or an
    iter_XXXXXXX directory, or an exported HF directory (config.json + model.safetensors).
    The tokenizer is the one given (`tokenizer_options`: TikTokenizer's, `TokenizerConfig.options()`),
    else the checkpoint's recorded one (with its options), else the HF directory's. A checkpoint's
    record is held to (`recorded_tokenizer_config`): a tokenizer of other content or options, or a
    recorded file gone or changed, is refused."""
    if os.path.isfile(os.path.join(path, "config.json")):
        if use_ema:
            raise InputError(f"--use-ema applies to megatron checkpoints; {path} is an HF directory "
                             f"(export it with tools/convert_to_hf.py --use-ema)")
        model, config = _from_hf(path, tokenizer_type, tokenizer_model, tokenizer_options)
        source = "hf"
    elif os.path.isdir(path):
        model, config = _from_megatron(path, use_ema, tokenizer_type, tokenizer_model, tokenizer_options)
        source = "megatron"
    else:
        raise FileNotFoundError(f"--load {path}: no such directory (expected a megatron checkpoint or an "
                                f"HF directory with config.json)")
    tokenizer = config.build() if config is not None else None
    cfg = model.config
    if tokenizer is not None and (tokenizer.vocab_size, tokenizer.mask_id) != (cfg.vocab_size, cfg.mask_token_id):
        raise InputError(f"--load {path}: the model's vocabulary ({cfg.vocab_size}, [MASK] {cfg.mask_token_id}) "
                         f"does not match the tokenizer's ({tokenizer.vocab_size}, [MASK] {tokenizer.mask_id}); "
                         f"give the tokenizer flags the model was trained with")
    if tokenizer is None and source == "hf" and os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        tokenizer = HFDirTokenizer(path)
    model = model.to(device=device, dtype=dtype).eval()
    return InferenceModel(model, cfg.family, cfg.mask_token_id, cfg.vocab_size,
                          cfg.max_position_embeddings, tokenizer, source, config,
                          dict(getattr(cfg, "family_options", None) or {}))
