"""Model sizes: the paper's 28 IsoFLOP presets (table `tab:model_sizes`) plus small CPU presets.

Presets are named by their non-embedding parameter count in millions for the 32001-token
vocabulary, as in the paper's table (all parameters minus the input embedding matrix; the untied
output layer counts).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_dllm.errors import InputError
from megatron_dllm.model.gpt_shape import GPTShape


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    num_layers: int
    num_attention_heads: int

    @property
    def ffn_hidden_size(self) -> int:
        return 4 * self.hidden_size

    def check_layout(self, tp: int, pp: int, vpp: int | None) -> None:
        """These sizes split over a parallel layout, and into heads of an even size (rotary
        embeddings turn channel pairs); checked for a run by config/validate.py, and for the
        converters that write a checkpoint at a chosen layout by model/builder.py."""
        if self.num_attention_heads % tp:
            raise InputError(f"--tensor-model-parallel-size {tp} does not divide the number of attention "
                             f"heads {self.num_attention_heads} of this preset")
        chunks = pp * (vpp or 1)
        if self.num_layers % chunks:
            raise InputError(f"--pipeline-model-parallel-size {pp} x --virtual-pipeline-model-parallel-size "
                             f"{vpp or 1} = {chunks} does not divide the {self.num_layers} layers of this preset")
        if self.hidden_size % self.num_attention_heads:
            raise InputError(f"--hidden-size {self.hidden_size} is not a multiple of --num-attention-heads "
                             f"{self.num_attention_heads}: every head takes hidden-size / heads channels")
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise InputError(f"--hidden-size {self.hidden_size} / --num-attention-heads {self.num_attention_heads} = "
                             f"{self.hidden_size // self.num_attention_heads} channels per head: rotary embeddings "
                             f"need an even number")


# name -> (n_embed, n_layers, n_heads), verbatim from the paper's table.
PAPER_PRESETS = {
    "14M": Preset(256, 6, 4), "29M": Preset(384, 8, 6), "44M": Preset(512, 8, 8),
    "58M": Preset(576, 9, 9), "74M": Preset(640, 10, 10), "91M": Preset(640, 13, 10),
    "107M": Preset(640, 16, 8), "116M": Preset(768, 12, 12), "140M": Preset(768, 15, 12),
    "163M": Preset(768, 18, 12), "173M": Preset(896, 14, 14), "194M": Preset(896, 16, 14),
    "214M": Preset(896, 18, 14), "247M": Preset(1024, 16, 16), "274M": Preset(1024, 18, 16),
    "300M": Preset(1024, 20, 16), "413M": Preset(1280, 18, 10), "475M": Preset(1280, 21, 10),
    "493M": Preset(1408, 18, 11), "537M": Preset(1280, 24, 10), "568M": Preset(1408, 21, 11),
    "642M": Preset(1408, 24, 11), "698M": Preset(1536, 22, 12), "787M": Preset(1536, 25, 12),
    "1016M": Preset(1792, 24, 14), "1208M": Preset(2048, 22, 16), "1364M": Preset(2048, 25, 16),
    "1708M": Preset(2176, 28, 17),
}

# Small sizes for CPU development, tests, the embedded default and the CPU IsoFLOP demo.
CPU_PRESETS = {
    "cpu-micro": Preset(32, 2, 2),
    "cpu-mini": Preset(48, 2, 3),
    "cpu-tiny": Preset(64, 2, 4),
    "cpu-small": Preset(128, 4, 4),
    "cpu-base": Preset(256, 6, 4),
}

# The paper's code (its configs/model/*.yaml) names the same 28 architectures differently from the
# table; each of its names is an alias of the preset with the same hidden size, layers and heads.
PAPER_CODE_NAMES = {
    "6M": "14M", "19M": "29M", "34M": "44M", "48M": "58M", "66M": "74M", "85M": "91M", "75M": "107M",
    "113M": "116M", "142M": "140M", "170M": "163M", "180M": "173M", "206M": "194M", "231M": "214M",
    "268M": "247M", "302M": "274M", "336M": "300M", "472M": "413M", "551M": "475M", "571M": "493M",
    "629M": "537M", "666M": "568M", "761M": "642M", "831M": "698M", "944M": "787M", "1233M": "1016M",
    "1476M": "1208M", "1678M": "1364M", "2121M": "1708M",
}

ALIASES = {"1.7B": "1708M", **PAPER_CODE_NAMES}


def _llama(h: int, layers: int, heads: int, groups: int, ffn: int, theta: int, eps: float, *,
           qkv_bias: bool = False, rope_scaling_factor: float | None = None,
           head_dim: int | None = None) -> tuple[Preset, GPTShape]:
    return Preset(h, layers, heads), GPTShape(
        ffn_hidden_size=ffn, num_query_groups=groups if groups != heads else None,
        kv_channels=head_dim if head_dim and head_dim != h // heads else None, normalization="RMSNorm",
        norm_epsilon=eps, swiglu=True, position_embedding_type="rope", rotary_base=theta,
        rope_scaling_factor=rope_scaling_factor, add_bias_linear=False, add_qkv_bias=qkv_bias)


# Released AR models' shapes for the GPT backbone (`--backbone gpt`), from their public config.json
# files on the Hugging Face hub (HuggingFaceTB/SmolLM2-*, meta-llama/Llama-3.2-*, Qwen/Qwen2.5-*):
# hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size,
# rope_theta, rms_norm_eps, rope_scaling (Llama 3.2: llama3, factor 32); all tie their embeddings.
GPT_PRESETS = {
    "smollm2-135m": _llama(576, 30, 9, 3, 1536, 100000, 1e-5),
    "smollm2-360m": _llama(960, 32, 15, 5, 2560, 100000, 1e-5),
    "smollm2-1.7b": _llama(2048, 24, 32, 32, 8192, 130000, 1e-5),
    "llama-3.2-1b": _llama(2048, 16, 32, 8, 8192, 500000, 1e-5, rope_scaling_factor=32.0),
    "llama-3.2-3b": _llama(3072, 28, 24, 8, 8192, 500000, 1e-5, rope_scaling_factor=32.0, head_dim=128),
    "qwen2.5-0.5b": _llama(896, 24, 14, 2, 4864, 1000000, 1e-6, qkv_bias=True),
    "qwen2.5-1.5b": _llama(1536, 28, 12, 2, 8960, 1000000, 1e-6, qkv_bias=True),
}

PRESETS = {**PAPER_PRESETS, **CPU_PRESETS, **{name: p for name, (p, _) in GPT_PRESETS.items()}}


def gpt_shape_of(name: str | None) -> GPTShape | None:
    """The GPT backbone shape a preset implies (a released model's), else None (a DiT size)."""
    entry = GPT_PRESETS.get(ALIASES.get(name, name)) if name else None
    return entry[1] if entry else None


def get_preset(name: str) -> Preset:
    name = ALIASES.get(name, name)
    if name not in PRESETS:
        raise InputError(f"--preset {name!r} is not a known preset; expected one of: "
                         f"{', '.join(PRESETS)} (aliases: 1.7B and the paper code's names "
                         f"{', '.join(PAPER_CODE_NAMES)})")
    return PRESETS[name]
