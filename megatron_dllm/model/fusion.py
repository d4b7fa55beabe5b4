"""Megatron-LM's fusion flags and `--compile-elementwise`: what each means for the DiT, resolved
against the platform into megatron-core's TransformerConfig fields.

    flag                      TransformerConfig field   in the DiT
    --bias-gelu-fusion        bias_activation_fusion    the MLP's bias + tanh-GELU as megatron-core's fused
                                                        `bias_gelu_impl` (compiled by megatron-core's jit_fuser)
    --bias-swiglu-fusion      bias_activation_fusion    the GPT backbone's SwiGLU MLPs: megatron-core's fused
                              (GPT backbone)            `bias_swiglu_impl`, which saves the first linear's output
                                                        once for the backward (its unfused SwiGLU keeps it for
                                                        the gate's half and copies the other)
    --bias-dropout-fusion     bias_dropout_fusion       the MLP's bias joins the bias + gate + residual region
                                                        (the DiT's bias-dropout-add: no dropout, an adaLN gate)
    --masked-softmax-fusion   masked_softmax_fusion     `--attention-backend local`: apex's scale + mask + softmax
                                                        kernels (fp16/bf16 and the shapes they take, else
                                                        megatron-core's unfused softmax, as Megatron-LM)
    --rope-fusion             apply_rope_fusion         never (an error): TransformerEngine's fused RoPE takes
                                                        one position table for the whole batch
    --gradient-accumulation-  gradient_accumulation_   each weight gradient added into its fp32 main gradient
      fusion                    fusion                  inside its GEMM (`WeightGradientKernels`; TE's layers
                                                        use TE's own)
    --compile-elementwise     -                         torch.compile of `elementwise.py`'s regions, the
                                                        rotary embedding included (`layer.DiTSelfAttention`),
                                                        and of the loss heads' passes over the logits
                                                        (`families.vocab_parallel.compiled_heads`)

Megatron-LM fuses by default and spells only the `--no-...` forms; here every flag takes both
forms and an absent flag takes the platform's default (`platform.fusion_defaults()`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megatron_dllm import platform
from megatron_dllm.errors import InputError


@dataclass(frozen=True)
class Fusion:
    """Which elementwise work runs fused. The default, all off, is the eager reference."""

    bias_gelu: bool = False
    bias_swiglu: bool = False
    bias_dropout: bool = False
    masked_softmax: bool = False
    compile_elementwise: bool = False
    gradient_accumulation: bool = False

    def config_fields(self) -> dict:
        """The block's TransformerConfig fields (the MLP's bias-GELU is set on its own config)."""
        return {"bias_dropout_fusion": self.bias_dropout, "masked_softmax_fusion": self.masked_softmax,
                "apply_rope_fusion": False, "gradient_accumulation_fusion": self.gradient_accumulation}

    def for_backbone(self, gpt) -> Fusion:
        """The fusions that apply to a backbone: the DiT's (bias-GELU, the compiled regions), or the
        GPT backbone's (`gpt`: its GPTShape) fused SwiGLU where its MLP has one."""
        if gpt is None:
            return dataclasses.replace(self, bias_swiglu=False)
        return dataclasses.replace(self, bias_gelu=False, compile_elementwise=False,
                                   bias_swiglu=self.bias_swiglu and gpt.swiglu)

    def describe(self) -> str:
        names = {"bias_gelu": "bias-gelu", "bias_swiglu": "bias-swiglu", "bias_dropout": "bias-dropout",
                 "masked_softmax": "masked-softmax",
                 "compile_elementwise": "compiled elementwise", "gradient_accumulation": "gradient-accumulation"}
        on = [name for field, name in names.items() if getattr(self, field)]
        return f"fusion: {', '.join(on) if on else 'none'}"


def resolve_fusion(attention_backend: str, *, bias_gelu: bool | None = None, bias_swiglu: bool | None = None,
                   bias_dropout: bool | None = None,
                   masked_softmax: bool | None = None, rope: bool | None = None,
                   compile_elementwise: bool | None = None, gradient_accumulation: bool | None = None) -> Fusion:
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
    given = {"bias_gelu": bias_gelu, "bias_swiglu": bias_swiglu, "bias_dropout": bias_dropout,
             "masked_softmax": masked_softmax, "compile_elementwise": compile_elementwise,
             "gradient_accumulation": gradient_accumulation}
    chosen = {name: defaults[name] if value is None else value for name, value in given.items()}
    chosen["masked_softmax"] = chosen["masked_softmax"] and local
    if chosen["gradient_accumulation"] and not platform.fp32_accumulating_gemm():
        if gradient_accumulation:
            raise InputError(f"--gradient-accumulation-fusion: torch {torch.__version__} cannot add a bf16 GEMM's "
                             "product into an fp32 gradient (torch.addmm with out_dtype); drop the flag")
        chosen["gradient_accumulation"] = False
    return Fusion(**chosen)


class WeightGradientKernels:
    """What megatron-core's linear layers call for gradient-accumulation fusion in place of Apex's
    `fused_weight_gradient_mlp_cuda`, built on torch's GEMM: a micro-batch's weight gradient is
    added into the weight's main gradient by the GEMM itself, so neither a separate gradient tensor
    nor DDP's `main_grad.add_` is made."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor):
        """main_grad [out, in] += grad_output [tokens, out]^T @ total_input [tokens, in]."""
        if main_grad.dtype == total_input.dtype:
            main_grad.addmm_(grad_output.t(), total_input)
        else:  # bf16 factors, fp32 sum (CUDA)
            torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=main_grad.dtype, out=main_grad)

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32  # a bf16 or fp16 main gradient: the factors' dtype


def provide_weight_gradient_kernels() -> None:
    """Hand megatron-core's linear layers `WeightGradientKernels`, unless Apex's are installed."""
    from megatron.core.tensor_parallel import layers

    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = WeightGradientKernels
        layers._grad_accum_fusion_available = True
