"""The shape of the GPT (Llama-style) backbone as Megatron-LM's GPT flags describe it: what a
`GPTModel` needs beyond hidden size, layers and heads. Kept free of megatron imports so that
presets and flags can name it cheaply."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_dllm.errors import InputError

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")


@dataclass(frozen=True)
class GPTShape:
    """What Megatron-LM's GPT flags say about a GPTModel beyond hidden size, layers and heads.
    Defaults are Megatron-LM's (a GPT-2-like model); a Llama is RMSNorm, SwiGLU, rope, no biases."""

    ffn_hidden_size: int
    num_query_groups: int | None = None  # None: as many as heads (no grouped-query attention)
    kv_channels: int | None = None  # None: hidden_size / heads
    normalization: str = "LayerNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    position_embedding_type: str = "learned_absolute"
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    rope_scaling_factor: float | None = None  # Llama-3 rope scaling (--use-rope-scaling); None: off
    add_bias_linear: bool = True
    add_qkv_bias: bool = False  # the flag; add_bias_linear implies a qkv bias too, as in Megatron-LM
    qk_layernorm: bool = False
    untie_embeddings_and_output_weights: bool = False

    def __post_init__(self):
        if self.normalization not in NORMALIZATIONS:
            raise InputError(f"--normalization {self.normalization!r}: expected one of {', '.join(NORMALIZATIONS)}")
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise InputError(f"--position-embedding-type {self.position_embedding_type!r}: the gpt backbone "
                             f"supports {', '.join(POSITION_EMBEDDING_TYPES)}")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, saved: dict) -> "GPTShape":
        """The shape of its `as_dict()` (a checkpoint's, a config.json's), each value of its field's
        type (sizes and the float settings positive)."""
        if not isinstance(saved, dict):
            raise InputError(f"expected a mapping of shape fields, got {saved!r}")
        for f in dataclasses.fields(cls):
            if f.name in saved and not _of_type(saved[f.name], f.type):
                raise InputError(f"{f.name} {saved[f.name]!r}: expected {f.type}" + (
                    " > 0" if f.type.split(" ")[0] in ("int", "float") else ""))
        return cls(**saved)

    def check_layout(self, num_attention_heads: int, tp: int) -> None:
        """Layouts the GPT backbone cannot shard stop here, naming the flag."""
        groups = self.num_query_groups or num_attention_heads
        if num_attention_heads % groups:
            raise InputError(f"--num-query-groups {groups} does not divide the {num_attention_heads} attention heads")
        if groups % tp:
            raise InputError(f"--tensor-model-parallel-size {tp} does not divide the {groups} query groups "
                             f"(--num-query-groups)")
        if self.ffn_hidden_size % tp:
            raise InputError(f"--tensor-model-parallel-size {tp} does not divide --ffn-hidden-size "
                             f"{self.ffn_hidden_size}")

    def config_fields(self, hidden_size: int, num_attention_heads: int) -> dict:
        """TransformerConfig fields, as Megatron-LM's `core_transformer_config_from_args` sets them."""
        import torch.nn.functional as F  # here: the flags import this module, and preprocessing needs no torch

        return {"ffn_hidden_size": self.ffn_hidden_size, "num_query_groups": self.num_query_groups,
                "kv_channels": self.kv_channels or hidden_size // num_attention_heads,
                "normalization": self.normalization, "layernorm_epsilon": self.norm_epsilon,
                "gated_linear_unit": self.swiglu, "activation_func": F.silu if self.swiglu else F.gelu,
                "add_bias_linear": self.add_bias_linear, "add_qkv_bias": self.add_qkv_bias or self.add_bias_linear,
                "qk_layernorm": self.qk_layernorm}


def _of_type(value, annotation: str) -> bool:
    """Whether `value` is of a field's type, `annotation` as written ("int | None"); numbers > 0."""
    kind, _, optional = annotation.partition(" | ")
    if value is None:
        return optional == "None"
    if isinstance(value, bool) != (kind == "bool"):
        return False
    return isinstance(value, {"int": int, "float": (int, float), "str": str, "bool": bool}[kind]) and (
        kind not in ("int", "float") or value > 0)


def megatron_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron-LM's default --ffn-hidden-size: 4h, or with --swiglu 2/3 of it rounded down to 64."""
    return int(4 * hidden_size * 2 / 3 / 64) * 64 if swiglu else 4 * hidden_size
