"""Which backbone is trained and, for the GPT (Llama-style) one, Megatron-LM's GPT flags with
their names, defaults and meanings (megatron-core 0.16.1's `arguments.py`):

    --backbone dit                 the paper's DiT (adaLN time conditioning); the default
    --backbone gpt                 megatron-core's GPTModel (model/gpt.py); implied by a released
                                   model's preset (smollm2-135m, llama-3.2-1b, qwen2.5-0.5b, ...)

A preset of a released model sets every GPT flag; flags given with it override it (the on/off
flags can only turn a feature on, as in Megatron-LM). Without such a preset the GPT flags
default to Megatron-LM's (LayerNorm, GELU, biases, learned absolute positions, tied embeddings);
a Llama is `--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear`
(+ `--group-query-attention --num-query-groups N`; Qwen2 adds `--add-qkv-bias`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_dllm.config.fields import FlagGroup, flag, positive_float, positive_fraction, positive_int
from megatron_dllm.errors import InputError
from megatron_dllm.model.gpt_shape import NORMALIZATIONS, POSITION_EMBEDDING_TYPES, GPTShape, megatron_ffn_hidden_size
from megatron_dllm.model.presets import Preset, gpt_shape_of

BACKBONES = ("dit", "gpt")


@dataclass(frozen=True)
class BackboneConfig(FlagGroup):
    GROUP = "backbone (Megatron-LM's GPT flags for --backbone gpt)"
    backbone: str | None = flag(choices=BACKBONES, help="dit (the paper's DiT, default) | gpt (megatron-core's "
                                                        "GPTModel, Llama-style with its flags; implied by a "
                                                        "released model's preset)")
    ffn_hidden_size: int | None = flag(type=positive_int, help="default 4h, with --swiglu int(8h/3/64)*64")
    kv_channels: int | None = flag(type=positive_int, help="head dimension (default hidden / heads)")
    group_query_attention: bool = flag(False, action="store_true", help="grouped-query attention")
    num_query_groups: int | None = flag(type=positive_int, help="key/value heads with --group-query-attention "
                                                                "(Megatron-LM's default 1)")
    normalization: str | None = flag(choices=NORMALIZATIONS, help="default LayerNorm")
    norm_epsilon: float | None = flag(type=positive_float, help="default 1e-5")
    swiglu: bool = flag(False, action="store_true", help="SiLU-gated MLP (Llama) instead of GELU")
    position_embedding_type: str | None = flag(choices=POSITION_EMBEDDING_TYPES, help="default learned_absolute")
    rotary_base: int | None = flag(type=positive_int, help="rope base (default 10000)")
    rotary_percent: float | None = flag(type=positive_fraction, help="fraction of the head dimension rotated "
                                                                  "(default 1.0)")
    use_rope_scaling: bool = flag(False, action="store_true", help="Llama-3.x rope scaling")
    rope_scaling_factor: float | None = flag(type=positive_float, help="with --use-rope-scaling (default 8.0)")
    disable_bias_linear: bool = flag(False, action="store_true", help="no biases in the linear layers")
    add_qkv_bias: bool = flag(False, action="store_true", help="a bias on the qkv projection only (Qwen2)")
    qk_layernorm: bool = flag(False, action="store_true", help="normalise queries and keys per head")
    untie_embeddings_and_output_weights: bool = flag(False, action="store_true",
                                                     help="a separate output layer (tied by default)")
    shift: bool = flag(False, action="store_true", help="MDLM adapted from an AR model (as Dream): the logits at "
                                                       "position i-1 predict token i; any backbone")

    def gpt_flags_given(self) -> list[str]:
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return ["--" + name.replace("_", "-") for name, value in dataclasses.asdict(self).items()
                if name not in ("backbone", "shift") and value != defaults[name]]

    def gpt_shape(self, preset_name: str | None, preset: Preset) -> GPTShape | None:
        """The GPT shape of a run (None: the DiT): the preset's, overridden by the flags given."""
        base = gpt_shape_of(preset_name)
        given = self.gpt_flags_given()
        backbone = self.backbone or ("gpt" if base else "dit")
        if backbone == "dit":
            # the GPT flags shape the GPT backbone only
            if given:
                raise InputError(f"{given[0]} applies to --backbone gpt (this run trains the DiT)")
            if base:
                raise InputError(f"--preset {preset_name} is a GPT-backbone model; drop --backbone dit")
            return None
        # --num-query-groups means something only with --group-query-attention
        if self.num_query_groups is not None and not self.group_query_attention:
            raise InputError("--num-query-groups needs --group-query-attention")
        # --rope-scaling-factor means something only with --use-rope-scaling
        if self.rope_scaling_factor is not None and not self.use_rope_scaling:
            raise InputError("--rope-scaling-factor needs --use-rope-scaling")
        b = base or GPTShape(ffn_hidden_size=0)
        swiglu = self.swiglu or b.swiglu
        if self.ffn_hidden_size:
            ffn = self.ffn_hidden_size
        elif base and swiglu == base.swiglu:
            ffn = base.ffn_hidden_size
        else:
            ffn = megatron_ffn_hidden_size(preset.hidden_size, swiglu)
        changes = {
            "swiglu": swiglu, "ffn_hidden_size": ffn,
            "num_query_groups": (self.num_query_groups or 1) if self.group_query_attention else b.num_query_groups,
            "kv_channels": self.kv_channels or b.kv_channels,
            "normalization": self.normalization or b.normalization,
            "norm_epsilon": self.norm_epsilon or b.norm_epsilon,
            "position_embedding_type": self.position_embedding_type or b.position_embedding_type,
            "rotary_base": self.rotary_base or b.rotary_base,
            "rotary_percent": self.rotary_percent or b.rotary_percent,
            "rope_scaling_factor": (self.rope_scaling_factor or 8.0) if self.use_rope_scaling
            else b.rope_scaling_factor,
            "add_bias_linear": b.add_bias_linear and not self.disable_bias_linear,
            "add_qkv_bias": self.add_qkv_bias or b.add_qkv_bias,
            "qk_layernorm": self.qk_layernorm or b.qk_layernorm,
            "untie_embeddings_and_output_weights": self.untie_embeddings_and_output_weights
            or b.untie_embeddings_and_output_weights,
        }
        return dataclasses.replace(b, **changes)


def gpt_flags(preset: Preset, shape: GPTShape) -> list[str]:
    """The command-line flags that describe `preset` + `shape` in full (what a converted checkpoint
    is trained with, printed by the importer)."""
    flags = ["--backbone", "gpt", "--num-layers", str(preset.num_layers), "--hidden-size", str(preset.hidden_size),
             "--num-attention-heads", str(preset.num_attention_heads), "--ffn-hidden-size",
             str(shape.ffn_hidden_size), "--normalization", shape.normalization, "--norm-epsilon",
             repr(shape.norm_epsilon), "--position-embedding-type", shape.position_embedding_type]
    if shape.num_query_groups is not None:
        flags += ["--group-query-attention", "--num-query-groups", str(shape.num_query_groups)]
    if shape.kv_channels is not None:
        flags += ["--kv-channels", str(shape.kv_channels)]
    if shape.position_embedding_type == "rope":
        flags += ["--rotary-base", str(shape.rotary_base)]
        if shape.rotary_percent != 1.0:
            flags += ["--rotary-percent", repr(shape.rotary_percent)]
        if shape.rope_scaling_factor is not None:
            flags += ["--use-rope-scaling", "--rope-scaling-factor", repr(shape.rope_scaling_factor)]
    flags += [name for name, on in (("--swiglu", shape.swiglu), ("--disable-bias-linear", not shape.add_bias_linear),
                                    ("--add-qkv-bias", shape.add_qkv_bias and not shape.add_bias_linear),
                                    ("--qk-layernorm", shape.qk_layernorm),
                                    ("--untie-embeddings-and-output-weights",
                                     shape.untie_embeddings_and_output_weights)) if on]
    return flags
