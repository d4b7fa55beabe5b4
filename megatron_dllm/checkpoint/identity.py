"""What a checkpoint's weights are: the family and the sizes that shape every tensor.

One object converts between the forms this identity takes: the run's architecture, the dict a
checkpoint stores under "identity" in its common state, and the fields of an exported Hugging
Face `config.json`. A checkpoint loads only into a run of the same identity; a `--finetune` may
change the family (the weights' shapes do not depend on it).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megatron_dllm.checkpoint.manifest import CheckpointError
from megatron_dllm.errors import InputError

# HF config.json field -> identity field (the HF config says num_heads and mask_token_id)
_HF_FIELDS = {"family": "family", "hidden_size": "hidden_size", "num_layers": "num_layers",
              "num_heads": "num_attention_heads", "vocab_size": "vocab_size", "mask_token_id": "mask_id"}


@dataclass(frozen=True)
class ModelIdentity:
    family: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    vocab_size: int  # the real vocabulary, [MASK] included; megatron pads it per layout
    mask_id: int
    gpt: dict | None = None  # the GPT backbone's shape (model.gpt_shape.GPTShape); None: the DiT
    # what else fixes the model's meaning (BD3-LM: block_size, noise); empty for the other families
    family_options: dict = field(default_factory=dict)

    @classmethod
    def of(cls, family, arch) -> "ModelIdentity":
        """The identity of a run: its `families.Family` and `model.builder.Architecture`."""
        p = arch.preset
        return cls(family.name, p.hidden_size, p.num_layers, p.num_attention_heads, arch.vocab_size, family.mask_id,
                   arch.gpt.as_dict() if arch.gpt is not None else None, family.options())

    def architecture(self, seq_length: int, make_vocab_size_divisible_by: int = 128):
        """The `Architecture` to rebuild this model at `seq_length`."""
        from megatron_dllm.families import FAMILIES
        from megatron_dllm.model.builder import Architecture
        from megatron_dllm.model.gpt_shape import GPTShape
        from megatron_dllm.model.presets import Preset

        return Architecture(Preset(self.hidden_size, self.num_layers, self.num_attention_heads), self.vocab_size,
                            int(seq_length), FAMILIES[self.family].attention, make_vocab_size_divisible_by,
                            gpt=GPTShape.from_dict(self.gpt) if self.gpt is not None else None)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, saved: dict | None, source: str) -> "ModelIdentity":
        optional = ("gpt", "family_options")  # DiT checkpoints have no gpt; older ones no family_options
        fields = [f.name for f in dataclasses.fields(cls) if f.name not in optional]
        if not saved or any(k not in saved for k in fields):
            raise CheckpointError(f"{source}: no model identity ({', '.join(fields)}) in its common state; "
                                  f"is it a megatron_dllm checkpoint?")
        return cls(**{k: saved[k] for k in fields}, gpt=saved.get("gpt"),
                   family_options=dict(saved.get("family_options") or {}))

    def differences(self, saved: dict, weights_only: bool = False) -> list[str]:
        """`key: checkpoint X vs this run Y` for every field where `saved` differs. `weights_only`
        (--finetune) compares only what shapes the weights: the family and its options are the
        objective trained on them, which a fine-tune may change (an AR model adapted to Eso-LM,
        MDLM or Duo: every family has the same parameters on a backbone)."""
        saved = {"family_options": {}, **saved}  # checkpoints written before the field: no options
        objective = ("family", "family_options") if weights_only else ()
        return [f"{k}: checkpoint {saved.get(k)!r} vs this run {v!r}" for k, v in self.as_dict().items()
                if saved.get(k) != v and k not in objective]

    @classmethod
    def from_hf_config(cls, config: dict, source: str) -> "ModelIdentity":
        from megatron_dllm.families import FAMILIES

        missing = [k for k in _HF_FIELDS if k not in config]
        if missing:
            raise InputError(f"{source}: missing {', '.join(missing)}")
        sizes = [f"{k} {config[k]!r}" for k in _HF_FIELDS if k != "family" and not (
            isinstance(config[k], int) and not isinstance(config[k], bool) and config[k] >= (k != "mask_token_id"))]
        if sizes:
            raise InputError(f"{source}: {', '.join(sizes)}: expected integers (sizes >= 1, mask_token_id >= 0)")
        if not isinstance(config.get("family_options") or {}, dict):
            raise InputError(f"{source}: family_options {config['family_options']!r} is not a mapping")
        if not isinstance(config["family"], str) or config["family"] not in FAMILIES:
            raise InputError(f"{source}: family {config['family']!r}, expected one of {', '.join(FAMILIES)}")
        gpt = config.get("gpt")
        if gpt is not None:
            from megatron_dllm.model.gpt_shape import GPTShape

            try:
                gpt = GPTShape.from_dict(gpt).as_dict()
            except (TypeError, InputError) as err:
                raise InputError(f"{source}: gpt {gpt!r} is not a GPT backbone shape ({err})") from None
        return cls(**{ours: config[theirs] for theirs, ours in _HF_FIELDS.items()}, gpt=gpt,
                   family_options=dict(config.get("family_options") or {}))

    def hf_config_fields(self) -> dict:
        """config.json's fields; `gpt` (the GPT backbone's shape) and `family_options` when set."""
        fields = {theirs: getattr(self, ours) for theirs, ours in _HF_FIELDS.items()}
        optional = {"gpt": self.gpt, "family_options": self.family_options}
        return {**fields, **{k: v for k, v in optional.items() if v}}
