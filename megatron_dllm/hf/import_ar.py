"""Write a released autoregressive model (`hf.pretrained_ar`) as a megatron_dllm checkpoint of
the GPT backbone at any TP/PP layout: each rank builds its GPTBackbone chunk, takes its shard of
every whole tensor, and megatron-core's distributed checkpointing writes the shards (the same
format training resumes and fine-tunes from, so it reshards on load).

Vocabulary: the checkpoint's tokenizer is the directory's tokenizer.json (copied into
`SAVE/tokenizer/` once the checkpoint is written, so a failed `--overwrite` leaves the old one,
and recorded), with this project's [MASK] rule: an existing `<mask>`/`[MASK]`
token, else the id after the tokenizer's last one. Embedding rows the model lacks (that
appended [MASK]) start at the mean of its embedding rows; an untied output layer's new rows at
zero; megatron's padding rows at zero. Without a tokenizer.json the vocabulary is the model's
rows plus an appended [MASK].
"""
from __future__ import annotations

import os
import shutil
from dataclasses import replace

import torch

from megatron_dllm import platform
from megatron_dllm.checkpoint.identity import ModelIdentity
from megatron_dllm.errors import InputError
from megatron_dllm.hf import pretrained_ar

# chat_template.jinja: where transformers 5 saves a chat template (4 kept it in tokenizer_config.json)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _tokenizer(hf: str, staging: str, target: str):
    """(vocab_size, mask_id, tokenizer record or None); the tokenizer files are copied into
    `staging` (for `_publish_tokenizer`) and recorded at `target`."""
    if not os.path.isfile(os.path.join(hf, "tokenizer.json")):
        return None
    from megatron_dllm.checkpoint.tokenizer_record import TokenizerRecord
    from megatron_dllm.config.data import TokenizerConfig
    from megatron_dllm.data.tokenizers import build_tokenizer

    if torch.distributed.get_rank() == 0:
        os.makedirs(staging)
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(hf, name)):
                shutil.copyfile(os.path.join(hf, name), os.path.join(staging, name))
    torch.distributed.barrier()
    tok = build_tokenizer("HuggingFaceTokenizer", staging)
    record = TokenizerRecord.of(TokenizerConfig.from_options("HuggingFaceTokenizer", tok.model_path, None))
    final = os.path.abspath(os.path.join(target, os.path.relpath(tok.model_path, staging)))
    return tok.vocab_size, tok.mask_id, replace(record, model=final)


def _publish_tokenizer(staging: str, target: str) -> None:
    """The staged tokenizer in place of `target` (the replaced checkpoint's, with --overwrite)."""
    if os.path.isdir(target):
        shutil.rmtree(target)
    os.replace(staging, target)


def _vocab_rows(full: torch.Tensor, rows: int, real: int, fill_mean: bool) -> torch.Tensor:
    """The model's rows, new real rows (up to `real`) at the mean (or zero), padding at zero."""
    out = torch.zeros(rows, full.shape[1], dtype=full.dtype)
    kept = min(rows, full.shape[0])
    out[:kept] = full[:kept]
    if fill_mean and real > full.shape[0]:
        out[full.shape[0]:real] = full.mean(0)
    return out


def import_checkpoint(args) -> int:
    """--hf DIR --save CKPT --family F at --tensor/--pipeline-model-parallel-size; rank 0 reports."""
    from megatron_dllm.checkpoint import layout
    from megatron_dllm.config.backbone import gpt_flags

    if (layout.iterations(args.save) or layout.read_tracker(args.save) is not None) and not args.overwrite:
        raise InputError(f"--save {args.save} already holds a checkpoint; pass --overwrite to replace it")
    config = pretrained_ar.read_config(args.hf)
    source = f"--hf {os.path.join(args.hf, 'config.json')}"
    preset, shape, hf_rows = pretrained_ar.shape_of(config, source)
    whole = pretrained_ar.to_megatron(pretrained_ar.read_weights(args.hf), preset, shape, f"--hf {args.hf}")
    if whole["embedding.word_embeddings.weight"].shape[0] != hf_rows:
        raise InputError(f"{source}: vocab_size {hf_rows} but the embedding has "
                         f"{whole['embedding.word_embeddings.weight'].shape[0]} rows")
    platform.init_distributed(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    target = os.path.join(args.save, "tokenizer")
    staging = target + ".staging"  # one name for every rank; --save's lock keeps other writers out
    first = torch.distributed.get_rank() == 0
    if first and os.path.isdir(staging):  # a killed import's
        shutil.rmtree(staging)
    try:
        path, vocab_size, mask_id, record = _write(args, config, whole, hf_rows, preset, shape, staging, target)
        if record is not None and first:
            _publish_tokenizer(staging, target)
    finally:
        if first and os.path.isdir(staging):
            shutil.rmtree(staging)
    if first:
        name = (config.get("architectures") or [config["model_type"]])[0]
        print(f"wrote {path} ({name} as --family {args.family}, TP={args.tensor_model_parallel_size}, "
              f"PP={args.pipeline_model_parallel_size}, model weights only; vocabulary {vocab_size}, [MASK] id "
              f"{mask_id}{', tokenizer ' + record.model if record else ', no tokenizer.json in --hf'})")
        print("train it with: " + " ".join(gpt_flags(preset, shape)))
    return 0


def _write(args, config: dict, whole: dict, hf_rows: int, preset, shape, staging: str, target: str):
    """The checkpoint of `whole` at --save, its tokenizer staged; (path, vocab size, [MASK] id,
    tokenizer record)."""
    from megatron_dllm.families import FAMILIES
    from megatron_dllm.model.builder import Architecture

    tokenizer = _tokenizer(args.hf, staging, target)
    if tokenizer is not None:
        vocab_size, mask_id, record = tokenizer
        missing = vocab_size - hf_rows - (1 if hf_rows <= mask_id < vocab_size else 0)  # [MASK] gets a row
        if missing > 0:  # ids with no embedding row: transformers fails on them, here they would be invented
            raise InputError(f"--hf {os.path.join(args.hf, 'tokenizer.json')}: the tokenizer has {vocab_size} ids "
                             f"(with [MASK]), {missing} of them beyond the model's {hf_rows} embedding rows; "
                             f"expected the model's own tokenizer")
    elif isinstance(config.get("mask_token_id"), int):  # this project's export: [MASK] is a row of the model
        vocab_size, mask_id, record = hf_rows, config["mask_token_id"], None
    else:  # a released model: [MASK] appended
        vocab_size, mask_id, record = hf_rows + 1, hf_rows, None
    seq_length = args.seq_length or int(config.get("max_position_embeddings", 2048))
    arch = Architecture(preset, vocab_size, seq_length, FAMILIES[args.family].attention,
                        args.make_vocab_size_divisible_by, gpt=shape)
    identity = ModelIdentity.of(FAMILIES[args.family](mask_id=mask_id, vocab_size=vocab_size), arch)
    return write_gpt_checkpoint(whole, identity, arch, args, record, f"--hf {args.hf}"), vocab_size, mask_id, record


def write_gpt_checkpoint(whole: dict, identity: ModelIdentity, arch, args, record, source: str) -> str:
    """Write the whole (TP=1) GPTBackbone tensors `whole` (global names, the model's vocabulary
    rows) as a checkpoint of `identity` at the layout of `args` (--save, --tensor/--pipeline-model-
    parallel-size, --iteration, --overwrite), each rank its shard; `record`: its tokenizer or None.
    Distributed state must be initialised at that layout. Returns the checkpoint's path."""
    from megatron.core import parallel_state

    from megatron_dllm.checkpoint import layout
    from megatron_dllm.hf import export
    from megatron_dllm.model.builder import build_model, transformer_config
    from megatron_dllm.model.init import tp_shard

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cfg, _ = transformer_config(arch, tp=tp, pp=pp)
    model = build_model(arch, cfg, cfg, seed=0)[0]
    padded = arch.padded_vocab_size(tp)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tied = model.share_embeddings_and_output_weights
    state = {}
    for name, param in model.named_parameters():
        global_name = name
        if name.startswith("decoder.layers."):
            i, rest = name[len("decoder.layers."):].split(".", 1)
            global_name = f"decoder.layers.{model.layer_offset + int(i)}.{rest}"
        if tied and name == "output_layer.weight":
            global_name = "embedding.word_embeddings.weight"
        value = whole[global_name]
        if global_name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            value = _vocab_rows(value, padded, arch.vocab_size, fill_mean=global_name.startswith("embedding"))
        value = tp_shard(value, param, tp, tp_rank, gated_fc1=arch.gpt.swiglu and ".mlp.linear_fc1." in name)
        if value.shape != param.shape:
            raise InputError(f"{name}: shape {tuple(value.shape)} from {source} vs model {tuple(param.shape)}")
        state[name] = value.to(param.dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any("_extra_state" not in k for k in missing):
        raise InputError(f"{source}: tensors missing {missing[:5]}, unexpected {unexpected[:5]}")
    path = export.save_megatron_checkpoint(args.save, model, identity, args.iteration, arch.seq_length, record)
    if torch.distributed.get_rank() == 0 and args.overwrite:  # the new checkpoint is complete and tracked
        for old in (p for it, p in layout.iterations(args.save).items() if it != args.iteration):
            shutil.rmtree(old)
    return path
