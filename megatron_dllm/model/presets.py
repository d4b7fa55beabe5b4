"""Model sizes: the paper's 28 IsoFLOP presets (table `tab:model_sizes`) plus small CPU presets.

Presets are named by their non-embedding parameter count in millions for the 32001-token
vocabulary, as in the paper's table (all parameters minus the input embedding matrix; the untied
output layer counts).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_dllm.errors import InputError


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    num_layers: int
    num_attention_heads: int

    @property
    def ffn_hidden_size(self) -> int:
        return 4 * self.hidden_size

    def check_layout(self, tp: int, pp: int, vpp: int | None) -> None:
        """These sizes split over a parallel layout (checked for a run by config/validate.py, and
        for the converters that write a checkpoint at a chosen layout by model/builder.py)."""
        if self.num_attention_heads % tp:
            raise InputError(f"--tensor-model-parallel-size {tp} does not divide the number of attention "
                             f"heads {self.num_attention_heads} of this preset")
        chunks = pp * (vpp or 1)
        if self.num_layers % chunks:
            raise InputError(f"--pipeline-model-parallel-size {pp} x --virtual-pipeline-model-parallel-size "
                             f"{vpp or 1} = {chunks} does not divide the {self.num_layers} layers of this preset")


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

PRESETS = {**PAPER_PRESETS, **CPU_PRESETS}


def get_preset(name: str) -> Preset:
    name = ALIASES.get(name, name)
    if name not in PRESETS:
        raise InputError(f"--preset {name!r} is not a known preset; expected one of: "
                         f"{', '.join(PRESETS)} (aliases: 1.7B and the paper code's names "
                         f"{', '.join(PAPER_CODE_NAMES)})")
    return PRESETS[name]
