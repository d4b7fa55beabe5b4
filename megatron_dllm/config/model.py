"""What model is trained: family, size, layer implementation, precision."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_dllm.config.fields import FlagGroup, flag, positive_int
from megatron_dllm.model.presets import ALIASES, PRESETS


@dataclass(frozen=True)
class ModelConfig(FlagGroup):
    GROUP = "model"
    family: str = flag("mdlm", help="model family: ar | mdlm | duo | esolm")
    loss: str | None = flag(help="training objective; mdlm, esolm: low-var (default) | nelbo; duo: nelbo; ar: nll")
    preset: str | None = flag(help=f"model size: {', '.join([*PRESETS, *ALIASES])}; default cpu-small on the "
                                   f"embedded demo, else 14M")
    num_layers: int | None = flag(type=positive_int, help="overrides the preset")
    hidden_size: int | None = flag(type=positive_int, help="overrides the preset")
    num_attention_heads: int | None = flag(type=positive_int, help="overrides the preset")
    seq_length: int | None = flag(type=positive_int, help="default 2048 (128 on the demo)")
    make_vocab_size_divisible_by: int = flag(128, type=positive_int, help="vocabulary padding multiple (x TP)")
    transformer_impl: str | None = flag(choices=["local", "transformer_engine"],
                                        help="default: transformer_engine when installed on a GPU, else local")
    recompute_activations: bool = flag(False, action="store_true", help="full activation recompute")


@dataclass(frozen=True)
class PrecisionConfig(FlagGroup):
    GROUP = "precision"
    bf16: bool = flag(False, action="store_true", help="bf16 params and compute (GPU; CPU runs fp32)")
    fp8_format: str | None = flag(choices=["e4m3", "hybrid"], help="TransformerEngine FP8 (H100)")
    fp8_recipe: str = flag("delayed", choices=["delayed", "tensorwise", "blockwise", "mxfp8"],
                           help="FP8 scaling recipe")
    fp8_amax_history_len: int = flag(1, type=positive_int, help="delayed scaling: amax history length")
    fp8_amax_compute_algo: str = flag("most_recent", choices=["most_recent", "max"],
                                      help="delayed scaling: amax choice")
