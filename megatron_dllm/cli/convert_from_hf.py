"""Import a Hugging Face directory written by tools/convert_to_hf.py back into a megatron_dllm
checkpoint (model weights + identity; no optimizer state) at any TP/PP layout:

    torchrun --nproc-per-node T*P tools/convert_from_hf.py --hf DIR --save CKPT \
        --tensor-model-parallel-size T --pipeline-model-parallel-size P [--overwrite]

--hf may also be a released autoregressive model's directory (Llama, Mistral, Qwen2, SmolLM2:
config.json + safetensors, sharded or not, optionally its tokenizer.json): it becomes a checkpoint
of the GPT backbone (`--backbone gpt`) for `--family` (default ar); the command prints the flags to
train it with (docs/pretrained-ar.md).

A --save directory that already holds a checkpoint is refused unless --overwrite, which removes
the checkpoints there once the new one is complete (other files are left alone). Bad input: one
`error: ...` line, exit code 2.
"""
import argparse
import contextlib
import os
import shutil
import sys

from megatron_dllm import platform  # first: on CPU it quiets megatron-core's fallback warnings
from megatron_dllm.checkpoint.identity import ModelIdentity
from megatron_dllm.cli import OneLineParser, reports_bad_input
from megatron_dllm.config.fields import non_negative_int, positive_int
from megatron_dllm.errors import InputError
from megatron_dllm.hf import config_check
from megatron_dllm.output_lock import OutputLock, lock_path_for_dir


@reports_bad_input()
def main(argv=None):
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf", required=True, help="directory with config.json and model.safetensors")
    parser.add_argument("--save", required=True, help="checkpoint root to write")
    parser.add_argument("--tensor-model-parallel-size", type=positive_int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=positive_int, default=1)
    parser.add_argument("--make-vocab-size-divisible-by", type=positive_int, default=128)
    parser.add_argument("--iteration", type=non_negative_int, default=0)
    parser.add_argument("--family", choices=["ar", "mdlm", "duo", "esolm"],
                        help="released AR models: the family the checkpoint is for (default ar)")
    parser.add_argument("--seq-length", type=positive_int,
                        help="released AR models: default max_position_embeddings")
    parser.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in --save")
    args = parser.parse_args(argv)
    return convert(args)


def _read_hf(hf: str):
    """(identity, config.json, weights) of an HF directory written by tools/convert_to_hf.py."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from megatron_dllm.hf.config_json import read_config_json

    config_path, weights_path = os.path.join(hf, "config.json"), os.path.join(hf, "model.safetensors")
    for path in (config_path, weights_path):
        if not os.path.isfile(path):
            raise InputError(f"--hf {hf}: {os.path.basename(path)} not found (expected an exported directory)")
    cfg = read_config_json(config_path, "--hf")
    identity = ModelIdentity.from_hf_config(cfg, f"--hf {config_path}")
    config_check.check_config(cfg, identity, f"--hf {config_path}")
    try:
        weights = load_file(weights_path)
    except SafetensorError as err:
        raise InputError(f"--hf {weights_path}: unreadable safetensors file ({err})") from None
    config_check.check_shapes(weights, identity, cfg.get("max_position_embeddings", 2048), f"--hf {weights_path}")
    return identity, cfg, weights


def convert(args) -> int:
    from megatron_dllm.checkpoint import layout
    from megatron_dllm.hf import export, pretrained_ar

    first = int(os.environ.get("RANK", "0")) == 0
    if first:
        layout.remove_at_exit_if_empty(args.save)
    if pretrained_ar.is_pretrained_ar(args.hf):
        from megatron_dllm.hf.import_ar import import_checkpoint

        args.family = args.family or "ar"
        with OutputLock(lock_path_for_dir(args.save), f"--save {args.save}") if first else contextlib.nullcontext():
            return import_checkpoint(args)
    identity, cfg, hf_state = _read_hf(args.hf)
    if args.family not in (None, identity.family):
        raise InputError(f"--family {args.family}: --hf {args.hf} is an export of family {identity.family}; "
                         f"--family applies to released autoregressive models")
    if args.seq_length is not None:
        raise InputError(f"--seq-length: --hf {args.hf} is an export, which records its own "
                         f"max_position_embeddings; --seq-length applies to released autoregressive models")
    seq_length = cfg.get("max_position_embeddings", export.DEFAULT_SEQ_LENGTH)
    if identity.gpt is not None:
        code = _write_gpt_checkpoint(hf_state, identity, seq_length, args)
    else:
        code = write_checkpoint(hf_state, identity, seq_length, args, source=args.hf)
    shipped = [name for name in ("tokenizer.model", "tokenizer.json") if os.path.isfile(os.path.join(args.hf, name))]
    if shipped and first:  # an export's tokenizer is a conversion of the training one: not recorded as it
        print(f"note: the checkpoint records no tokenizer ({', '.join(shipped)} in --hf {args.hf} stays there); "
              f"give --tokenizer-type/--tokenizer-model when sampling, evaluating or exporting it", file=sys.stderr)
    return code


def _write_gpt_checkpoint(hf_state: dict, identity: ModelIdentity, seq_length: int, args) -> int:
    """A diffusion export of the GPT backbone (modeling_dllm's dense GPT) as a megatron checkpoint."""
    import torch

    from megatron_dllm.hf import export_gpt, pretrained_ar
    from megatron_dllm.hf.import_ar import write_gpt_checkpoint

    arch = identity.architecture(seq_length, args.make_vocab_size_divisible_by)
    whole = pretrained_ar.to_megatron({k: v.float() for k, v in export_gpt.llama_names(hf_state).items()},
                                      arch.preset, arch.gpt, f"--hf {args.hf}")
    first = int(os.environ.get("RANK", "0")) == 0
    with OutputLock(lock_path_for_dir(args.save), f"--save {args.save}") if first else contextlib.nullcontext():
        from megatron_dllm.checkpoint import layout

        if (layout.iterations(args.save) or layout.read_tracker(args.save) is not None) and not args.overwrite:
            raise InputError(f"--save {args.save} already holds a checkpoint; pass --overwrite to replace it")
        platform.init_distributed(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
        path = write_gpt_checkpoint(whole, identity, arch, args, None, f"--hf {args.hf}")
    if torch.distributed.get_rank() == 0:
        print(f"wrote {path} (TP={args.tensor_model_parallel_size}, PP={args.pipeline_model_parallel_size}, "
              f"model weights only)")
    return 0


def write_checkpoint(hf_state: dict, identity: ModelIdentity, seq_length: int, args, source: str,
                     tokenizer=None) -> int:
    """Write the dense DiT weights `hf_state` ("backbone." names) as a megatron checkpoint at the
    layout of `args` (--save, --tensor/--pipeline-model-parallel-size, --make-vocab-size-divisible-by,
    --iteration, --overwrite), each rank its shard. Rank 0 holds --save's writer lock throughout."""
    first = int(os.environ.get("RANK", "0")) == 0
    with OutputLock(lock_path_for_dir(args.save), f"--save {args.save}") if first else contextlib.nullcontext():
        return _write_checkpoint(hf_state, identity, seq_length, args, source, tokenizer)


def _write_checkpoint(hf_state: dict, identity: ModelIdentity, seq_length: int, args, source: str,
                      tokenizer) -> int:
    import torch
    from megatron.core import parallel_state

    from megatron_dllm.checkpoint import layout
    from megatron_dllm.hf import export
    from megatron_dllm.model.builder import build_model, transformer_config

    if (layout.iterations(args.save) or layout.read_tracker(args.save) is not None) and not args.overwrite:
        raise InputError(f"--save {args.save} already holds a checkpoint; pass --overwrite to replace it")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    arch = identity.architecture(seq_length, args.make_vocab_size_divisible_by)
    platform.init_distributed(tp, pp)
    config, mlp_config = transformer_config(arch, tp=tp, pp=pp)
    model = build_model(arch, config, mlp_config, seed=0)[0]
    used = set()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    local = model.state_dict()
    new_state = {}
    for name, param in local.items():
        if "_extra_state" in name:
            new_state[name] = param
            continue
        global_name = name
        if name.startswith("layers."):
            i, rest = name[len("layers."):].split(".", 1)
            global_name = f"layers.{model.layer_offset + int(i)}.{rest}"
        value = export.hf_to_megatron_tensor(hf_state, global_name, identity.num_attention_heads,
                                             arch.padded_vocab_size(tp))
        used.add(export.megatron_name_to_hf(global_name))
        live = dict(model.named_parameters()).get(name)
        if live is not None and getattr(live, "tensor_model_parallel", False) and tp > 1:
            value = value.chunk(tp, dim=live.partition_dim)[tp_rank]
        if value.shape != param.shape:
            raise InputError(f"{name}: shape {tuple(value.shape)} from {source} vs model {tuple(param.shape)}")
        new_state[name] = value.to(param.dtype)
    model.load_state_dict(new_state)
    stages = [None] * torch.distributed.get_world_size()  # each pipeline stage uses its own layers' weights
    torch.distributed.all_gather_object(stages, used)
    unused = set(hf_state).difference(*stages)
    if unused:
        raise InputError(f"{source}: unused weights {sorted(unused)[:5]}")
    path = export.save_megatron_checkpoint(args.save, model, identity, args.iteration, arch.seq_length, tokenizer)
    if torch.distributed.get_rank() == 0:
        if args.overwrite:  # the new checkpoint is complete and tracked: the old ones go
            for old in (p for it, p in layout.iterations(args.save).items() if it != args.iteration):
                shutil.rmtree(old)
        print(f"wrote {path} (TP={tp}, PP={pp}, model weights only"
              + (f", tokenizer {tokenizer.model})" if tokenizer else ")"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
