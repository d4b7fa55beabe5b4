"""The whole run's configuration: one frozen dataclass per concern, parsed from Megatron-style
flags, and resolved (defaults, the embedded demo, the iteration budget) by pure functions that
return new objects.

    config = parse_args(argv)                          # flags -> RunConfig (validated: config/validate.py)
    config = resolve_defaults(config, demo_corpus)     # demo or paper defaults, min LR
    config = resolve_iterations(config, vocab_size)    # --train-iters | --train-samples | --train-flops

Resolution fills what no flag gave and turns the flags it resolves (--train-samples,
--train-flops, --train-data-path) into --train-iters and --data-path, clearing them: the resolved
configuration is what `run_config.yaml` holds, and it passes `validate` again.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass

from megatron_dllm.cli import OneLineParser
from megatron_dllm.config.backbone import BackboneConfig
from megatron_dllm.config.checkpoint import CheckpointConfig
from megatron_dllm.config.data import DataConfig, TokenizerConfig
from megatron_dllm.config.logs import LoggingConfig
from megatron_dllm.config.model import ModelConfig, PrecisionConfig
from megatron_dllm.config.optimizer import OptimizerConfig
from megatron_dllm.config.parallel import ParallelConfig
from megatron_dllm.config.training import TrainingConfig
from megatron_dllm.config.yaml_config import add_yaml_flag, expand_yaml
from megatron_dllm.errors import InputError
from megatron_dllm.model.gpt_shape import GPTShape
from megatron_dllm.model.presets import Preset, get_preset


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig
    precision: PrecisionConfig
    parallel: ParallelConfig
    training: TrainingConfig
    optimizer: OptimizerConfig
    data: DataConfig
    tokenizer: TokenizerConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    backbone: BackboneConfig

    def replace(self, **groups) -> "RunConfig":
        """A copy with fields of groups changed: replace(model={"preset": "14M"})."""
        return dataclasses.replace(self, **{name: getattr(self, name).replace(**changes)
                                            for name, changes in groups.items() if changes})

    @property
    def demo(self) -> bool:
        return self.data.data_path is None and self.data.train_data_path is None

    def preset(self) -> Preset:
        """The --preset with any --hidden-size/--num-layers/--num-attention-heads override applied."""
        m = self.model
        overrides = {"hidden_size": m.hidden_size, "num_layers": m.num_layers,
                     "num_attention_heads": m.num_attention_heads}
        return dataclasses.replace(get_preset(m.preset), **{k: v for k, v in overrides.items() if v})

    def gpt_shape(self) -> GPTShape | None:
        """The GPT backbone's shape (model.gpt_shape), or None when the run trains the DiT."""
        return self.backbone.gpt_shape(self.model.preset, self.preset())


_CLASSES = {"model": ModelConfig, "precision": PrecisionConfig, "parallel": ParallelConfig,
            "training": TrainingConfig, "optimizer": OptimizerConfig, "data": DataConfig,
            "tokenizer": TokenizerConfig, "checkpoint": CheckpointConfig, "logging": LoggingConfig,
            "backbone": BackboneConfig}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        description="Pretrain a diffusion or autoregressive language model (AR, MDLM, Duo, Eso-LM, BD3-LM) with "
                    "megatron-core.", allow_abbrev=False)
    for cls in _CLASSES.values():
        cls.add_arguments(parser)
    add_yaml_flag(parser)
    return parser


# Flags that stand for one another: one given on the command line displaces the others from a
# --yaml-cfg file (a run's run_config.yaml holds --train-iters; relaunched with --train-samples).
ALTERNATIVES = ((("train_iters",), ("train_samples",), ("train_flops",), ("train_epochs",)),
                (("lr_warmup_iters",), ("lr_warmup_fraction", "lr_warmup_min_iters")))
# What a run_config.yaml an earlier version wrote holds that the run did not apply: {flag's dest:
# whether the file's flags (dest -> (value, line)) show it unapplied}. Files written before
# --lr-warmup-iters and --lr-warmup-fraction were exclusive hold the default fraction beside the
# iterations the run was given; files written when --lr-wsd-decay-style defaulted to cosine hold
# it for every decay style.
SUPERSEDED = {"lr_warmup_fraction": lambda flags: "lr_warmup_iters" in flags,
              "lr_wsd_decay_style": lambda flags: flags.get("lr_decay_style", (None,))[0] != "WSD"}


def expand_run_yaml(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`argv` with a `--yaml-cfg FILE` of the training flags expanded in front (config/yaml_config.py)."""
    return expand_yaml(argv, parser, sections=[group.name for group in dataclasses.fields(RunConfig)],
                       alternatives=ALTERNATIVES, superseded=SUPERSEDED)


def parse_flags(argv: list[str] | None = None) -> RunConfig:
    """Flags -> RunConfig, each flag's own value checked (a bad one exits with one `error: ...`
    line naming it, exit code 2); whether the flags fit together is `validate`'s."""
    from megatron_dllm.data.datasets import parse_data_path
    from megatron_dllm.families import FAMILIES

    parser = build_parser()
    try:
        argv = expand_run_yaml(sys.argv[1:] if argv is None else argv, parser)
    except InputError as err:
        parser.error(str(err))
    if any(a.split("=", 1)[0] == "--num-layers-per-virtual-pipeline-stage" for a in argv):
        parser.error("--num-layers-per-virtual-pipeline-stage: give the chunks per pipeline stage instead, "
                     "--virtual-pipeline-model-parallel-size (Megatron-LM's --num-virtual-stages-per-pipeline-rank) "
                     "= the layers per pipeline stage / the layers per chunk")
    ns = parser.parse_args(argv)
    if ns.family not in FAMILIES:
        parser.error(f"--family {ns.family!r} is not a known family; expected one of: {', '.join(FAMILIES)}")
    for name in ("data_path", "train_data_path", "valid_data_path"):
        if getattr(ns, name):
            try:
                parse_data_path(getattr(ns, name), "--" + name.replace("_", "-"))
            except InputError as err:
                parser.error(str(err))
    if ns.ema_decay is not None and not 0 < ns.ema_decay < 1:
        parser.error(f"--ema-decay must lie in (0, 1), got {ns.ema_decay:g}")
    if ns.train_flops is not None and ns.train_flops <= 0:
        parser.error(f"--train-flops must be positive, got {ns.train_flops:g}")
    return RunConfig(**{name: cls.from_args(ns) for name, cls in _CLASSES.items()})


def parse_args(argv: list[str] | None = None) -> RunConfig:
    """Flags -> a validated RunConfig; a bad value or combination exits with one `error: ...`
    line naming the flags, exit code 2."""
    from megatron_dllm.config.validate import validate

    config = parse_flags(argv)
    try:
        return validate(config)
    except InputError as err:
        build_parser().error(str(err))


# ------------------------------------------------------------------ resolution (pure)

# On the embedded demo: sized for 2 CPU cores. Otherwise: the paper's sweep settings.
DEMO_DEFAULTS = {"model": {"preset": "cpu-small", "seq_length": 128},
                 "training": {"micro_batch_size": 8, "global_batch_size": 32, "train_iters": 300},
                 "optimizer": {"lr": 1e-3, "lr_warmup_fraction": 0.05},
                 "logging": {"eval_interval": 100, "tensorboard_dir": "runs/demo-{family}/tensorboard"},
                 "checkpoint": {"save": "runs/demo-{family}/checkpoints"}}
DEFAULTS = {"model": {"preset": "14M", "seq_length": 2048},
            "training": {"micro_batch_size": 2, "global_batch_size": 256},
            "optimizer": {"lr": 2e-4, "lr_warmup_fraction": 0.01}}


def _fill(config: RunConfig, defaults: dict) -> RunConfig:
    """Set the fields that no flag gave (None) to `defaults`."""
    family = config.model.family
    changes = {}
    for group, values in defaults.items():
        current = getattr(config, group)
        changes[group] = {k: v.format(family=family) if isinstance(v, str) else v for k, v in values.items()
                          if getattr(current, k) is None}
    if config.optimizer.lr_warmup_iters is not None:  # warmup given in iterations: no default fraction
        changes.get("optimizer", {}).pop("lr_warmup_fraction", None)
    return config.replace(**changes)


def resolve_defaults(config: RunConfig, demo_corpus: dict | None = None) -> RunConfig:
    """Fill the defaults: with no --data-path the embedded demo's small defaults (and, given
    `demo_corpus` as returned by `data.prep.demo.prepare_demo_corpus`, its data and tokenizer),
    else the paper's. Flags always win; resolving twice changes nothing."""
    if config.data.train_data_path is not None:  # Megatron-LM's per-split paths: the training blend
        config = config.replace(data={"data_path": config.data.train_data_path, "train_data_path": None})
    if config.demo:
        defaults = dict(DEMO_DEFAULTS)
        if config.checkpoint.save is None and config.checkpoint.load is None:  # the demo resumes its own run
            defaults["checkpoint"] = {**defaults["checkpoint"], "load": defaults["checkpoint"]["save"]}
        if config.checkpoint.save is not None:  # a run of its own: not into the demo run's TensorBoard
            defaults["logging"] = {k: v for k, v in defaults["logging"].items() if k != "tensorboard_dir"}
        training = config.training
        if any(length is not None for length in (training.train_samples, training.train_flops, training.train_epochs)):
            defaults["training"] = {k: v for k, v in defaults["training"].items() if k != "train_iters"}
        config = _fill(config, defaults)
        if demo_corpus is not None:
            config = config.replace(data={"data_path": [demo_corpus["data_prefix"]],
                                          "valid_data_path": [demo_corpus["valid_prefix"]]},
                                    tokenizer={"tokenizer_type": demo_corpus["tokenizer_type"],
                                               "tokenizer_model": demo_corpus["tokenizer_model"]})
    else:
        config = _fill(config, DEFAULTS)
    if config.optimizer.min_lr is None:
        config = config.replace(optimizer={"min_lr": config.optimizer.lr / 10})
    return config


def resolve_iterations(config: RunConfig, vocab_size: int) -> RunConfig:
    """--train-iters from --train-flops (rounded down: a run never exceeds its budget) or
    --train-samples (rounded down to whole global batches, as Megatron-LM), which are then cleared."""
    from megatron_dllm.config.validate import check_budget
    from megatron_dllm.scaling.flops import train_flops_per_sequence
    from megatron_dllm.scaling.plan import iterations_for_budget

    training = config.training
    if training.train_flops is not None:
        per_sequence = train_flops_per_sequence(config.preset(), vocab_size, config.model.backbone_length(),
                                                training.flops_convention, config.gpt_shape())
        iters = iterations_for_budget(training.train_flops, per_sequence, training.global_batch_size)
        check_budget(training.train_flops, per_sequence * training.global_batch_size, iters,
                     training.flops_convention, training.global_batch_size)
        return config.replace(training={"train_iters": iters, "train_flops": None})
    if training.train_samples is not None:  # whole global batches, rounded down as Megatron-LM does
        iters = training.train_samples // training.global_batch_size
        if iters < 1:
            raise InputError(f"--train-samples {training.train_samples} is less than one global batch "
                             f"(--global-batch-size {training.global_batch_size})")
        return config.replace(training={"train_iters": iters, "train_samples": None})
    if training.train_iters is None:
        raise InputError("give --train-iters, --train-samples or --train-flops")
    return config
