"""Megatron-LM's fusion flags and `--compile-elementwise`: what each means for the DiT, resolved
against the platform into megatron-core's TransformerConfig fields.

    flag                      TransformerConfig field   in the DiT
    --bias-gelu-fusion        bias_activation_fusion    the MLP's bias + tanh-GELU as megatron-core's fused
                                                        `bias_gelu_impl` (compiled by megatron-core's jit_fuser)
    --bias-dropout-fusion     bias_dropout_fusion       the MLP's bias joins the bias + gate + residual region
                                                        (the DiT's bias-dropout-add: no dropout, an adaLN gate)
    --masked-softmax-fusion   masked_softmax_fusion     `--attention-backend local`: apex's scale + mask + softmax
                                                        kernels (fp16/bf16 and the shapes they take, else
                                                        megatron-core's unfused softmax, as Megatron-LM)
    --rope-fusion             apply_rope_fusion         never (an error): TransformerEngine's fused RoPE takes
                                                        one position table for the whole batch
    --compile-elementwise     -                         torch.compile of `elementwise.py`'s regions, the
                                                        rotary embedding included (`layer.DiTSelfAttention`)

Megatron-LM fuses by default and spells only the `--no-...` forms; here every flag takes both
forms and an absent flag takes the platform's default (`platform.fusion_defaults()`).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_dllm import platform
from megatron_dllm.errors import InputError


@dataclass(frozen=True)
class Fusion:
    """Which elementwise work runs fused. The default, all off, is the eager reference."""

    bias_gelu: bool = False
    bias_dropout: bool = False
    masked_softmax: bool = False
    compile_elementwise: bool = False

    def config_fields(self) -> dict:
        """The block's TransformerConfig fields (the MLP's bias-GELU is set on its own config)."""
        return {"bias_dropout_fusion": self.bias_dropout, "masked_softmax_fusion": self.masked_softmax,
                "apply_rope_fusion": False}

    def describe(self) -> str:
        names = {"bias_gelu": "bias-gelu", "bias_dropout": "bias-dropout", "masked_softmax": "masked-softmax",
                 "compile_elementwise": "compiled elementwise"}
        on = [name for field, name in names.items() if getattr(self, field)]
        return f"fusion: {', '.join(on) if on else 'none'}"


def resolve_fusion(attention_backend: str, *, bias_gelu: bool | None = None, bias_dropout: bool | None = None,
                   masked_softmax: bool | None = None, rope: bool | None = None,
                   compile_elementwise: bool | None = None) -> Fusion:
    """The run's fusions: the flags given (True/False), the platform's defaults for the rest (None)."""
    if rope:
        raise InputError("--rope-fusion: TransformerEngine's fused RoPE takes one position table for the whole "
                         "batch, the DiT's positions are per sample (Eso-LM permutes them); drop the flag "
                         "(--compile-elementwise compiles the rotary embedding instead)")
    defaults = platform.fusion_defaults()
    # Only megatron-core's local core attention reads the flag: SDPA and TransformerEngine fuse the
    # softmax inside their attention kernels whatever it says (config/validate.py refuses the flag
    # with local attention where apex's kernels are missing).
    local = attention_backend == "local"
    given = {"bias_gelu": bias_gelu, "bias_dropout": bias_dropout, "masked_softmax": masked_softmax,
             "compile_elementwise": compile_elementwise}
    chosen = {name: defaults[name] if value is None else value for name, value in given.items()}
    chosen["masked_softmax"] = chosen["masked_softmax"] and local
    return Fusion(**chosen)
