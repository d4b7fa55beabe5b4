"""torchrun worker (2 ranks): released-model directories imported at TP=2 and at PP=2, each
checkpoint loaded back at the other layout (megatron-core reshards it), and the logits of causal
fp32 forwards compared with transformers' own on the same input.

    pretrained_ar_worker.py OUT_JSON HF_DIR [HF_DIR ...]

Writes {hf_dir: {"tp2->pp2": rel_err, "pp2->tp2": rel_err}} (rank 0).
"""
import json
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from megatron_dllm import platform
from megatron_dllm.checkpoint import locate
from megatron_dllm.checkpoint.identity import ModelIdentity
from megatron_dllm.hf.import_ar import import_checkpoint
from megatron_dllm.model.builder import build_model, transformer_config

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}


def convert(hf: str, save: str, tp: int, pp: int) -> None:
    args = SimpleNamespace(hf=hf, save=save, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                           make_vocab_size_divisible_by=1, iteration=0, overwrite=False, family="ar",
                           seq_length=None)
    import_checkpoint(args)


def logits_at(save: str, tp: int, pp: int, ids: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits [b, s, V] of the checkpoint at layout (tp, pp), on every rank."""
    platform.init_distributed(tp, pp)
    path = locate(save, None).path
    common = dist_checkpointing.load_common_state_dict(path)
    arch = ModelIdentity.from_dict(common["identity"], path).architecture(ids.shape[1], 1)
    config, _ = transformer_config(arch, tp=tp, pp=pp)
    model = build_model(arch, config, config, seed=123)[0]  # other weights than the checkpoint's
    sharded = {k: v for k, v in model.sharded_state_dict().items() if "_extra_state" not in k}
    loaded = dist_checkpointing.load(sharded, path)  # also returns the common state
    missing, unexpected = model.load_state_dict({k: loaded[k] for k in sharded}, strict=False)
    assert not unexpected and all("_extra_state" in k for k in missing), (missing, unexpected)
    model.eval()
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        if pp == 1:
            out = model(ids, positions, None)
        else:  # stage 0's hidden states go to stage 1 by hand
            stage = parallel_state.get_pipeline_model_parallel_rank()
            hidden = torch.empty(ids.shape[1], ids.shape[0], arch.preset.hidden_size)
            if stage == 0:
                dist.send(model(ids, positions, None).contiguous(), dst=1)
                out = None
            else:
                dist.recv(hidden, src=0)
                model.set_input_tensor(hidden)
                out = model(ids, positions, None)
            shared = [out]
            dist.broadcast_object_list(shared, src=1)
            out = shared[0]
        full = gather_from_tensor_model_parallel_region(out) if tp > 1 else out
    return full.transpose(0, 1)


def main():
    out_path, dirs = sys.argv[1], sys.argv[2:]
    platform.init_distributed(1, 1)
    results = {}
    for hf in dirs:
        import transformers

        ref_model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
        vocab = ref_model.config.vocab_size
        ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ref = ref_model(ids).logits
        saves = {}
        for name, (tp, pp) in LAYOUTS.items():
            saves[name] = os.path.join(os.path.dirname(out_path), f"{os.path.basename(hf)}-{name}")
            platform.init_distributed(tp, pp)
            convert(hf, saves[name], tp, pp)
            dist.barrier()
        results[hf] = {}
        for written, read in (("tp2", "pp2"), ("pp2", "tp2")):
            ours = logits_at(saves[written], *LAYOUTS[read], ids)[..., :vocab]
            results[hf][f"{written}->{read}"] = ((ours - ref).abs().max() / ref.abs().max()).item()
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    platform.destroy_distributed()


if __name__ == "__main__":
    main()
