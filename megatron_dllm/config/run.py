"""The whole run's configuration: one frozen dataclass per concern, parsed from Megatron-style
flags, and resolved (defaults, the embedded demo, the iteration budget) by pure functions that
return new objects.

    cfg = parse_args(argv)                       # flags -> RunConfig (impossible values rejected)
    cfg = resolve_defaults(cfg, demo_corpus)     # demo or paper defaults, min LR
    cfg = resolve_iterations(cfg, vocab_size)    # --train-iters | --train-samples | --train-flops
"""
from __future__ import annotations

import argparse
import dataclasses
import math
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
        return self.data.data_path is None

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
        description="Pretrain a DiT language model (AR, MDLM, Duo, Eso-LM) with megatron-core.", allow_abbrev=False)
    for cls in _CLASSES.values():
        cls.add_arguments(parser)
    add_yaml_flag(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> RunConfig:
    """Flags -> RunConfig; a bad value or combination exits with one `error: ...` line naming
    the flag, exit code 2."""
    from megatron_dllm.data.datasets import parse_data_path
    from megatron_dllm.families import FAMILIES

    parser = build_parser()
    try:
        argv = expand_yaml(sys.argv[1:] if argv is None else argv, parser)
    except InputError as err:
        parser.error(str(err))
    ns = parser.parse_args(argv)
    if ns.train_data_path is not None:
        if ns.data_path is not None or ns.valid_data_path is None:
            parser.error("--train-data-path goes with --valid-data-path and replaces --data-path")
        ns.data_path = ns.train_data_path
    if ns.family not in FAMILIES:
        parser.error(f"--family {ns.family!r} is not a known family; expected one of: {', '.join(FAMILIES)}")
    for name in ("data_path", "valid_data_path"):
        if getattr(ns, name):
            try:
                parse_data_path(getattr(ns, name), "--" + name.replace("_", "-"))
            except InputError as err:
                parser.error(str(err))
    tp = ns.tensor_model_parallel_size
    if ns.sequence_parallel and ns.seq_length and ns.seq_length % tp:
        parser.error(f"--seq-length {ns.seq_length} must be a multiple of --tensor-model-parallel-size {tp} "
                     f"under --sequence-parallel")
    if ns.ema_decay is not None and not 0 < ns.ema_decay < 1:
        parser.error(f"--ema-decay must lie in (0, 1), got {ns.ema_decay:g}")
    if ns.train_iters is not None and ns.train_samples is not None:
        parser.error("give --train-iters or --train-samples, not both")
    if ns.lr_warmup_min_iters and ns.lr_warmup_iters is not None:
        parser.error("--lr-warmup-min-iters bounds --lr-warmup-fraction; give it without --lr-warmup-iters")
    if ns.train_flops is not None:
        if ns.train_iters is not None or ns.train_samples is not None:
            parser.error("--train-flops sets the number of iterations; give it without --train-iters/--train-samples")
        if ns.train_flops <= 0:
            parser.error(f"--train-flops must be positive, got {ns.train_flops:g}")
    cfg = RunConfig(**{name: cls.from_args(ns) for name, cls in _CLASSES.items()})
    try:
        cfg.model.recompute()
        if cfg.model.preset is not None:
            cfg.gpt_shape()
    except InputError as err:
        parser.error(str(err))
    log = cfg.logging
    if log.profile and (log.profile_step_end <= log.profile_step_start or not log.tensorboard_dir and not cfg.demo):
        parser.error("--profile needs --profile-step-end > --profile-step-start and a --tensorboard-dir for "
                     "its traces")
    return cfg


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


def _fill(cfg: RunConfig, defaults: dict) -> RunConfig:
    """Set the fields that no flag gave (None) to `defaults`."""
    family = cfg.model.family
    changes = {}
    for group, values in defaults.items():
        current = getattr(cfg, group)
        changes[group] = {k: v.format(family=family) if isinstance(v, str) else v for k, v in values.items()
                          if getattr(current, k) is None}
    return cfg.replace(**changes)


def resolve_defaults(cfg: RunConfig, demo_corpus: dict | None = None) -> RunConfig:
    """Fill the defaults: with no --data-path the embedded demo (`demo_corpus`, as returned by
    `data.prep.demo.prepare_demo_corpus`) and its small defaults, else the paper's. Flags always win."""
    if cfg.demo:
        if cfg.tokenizer.tokenizer_type or cfg.tokenizer.tokenizer_model:
            raise InputError("--tokenizer-type/--tokenizer-model need --data-path (the embedded demo "
                             "brings its own tokenizer)")
        if demo_corpus is None:
            raise InputError("resolving the embedded demo needs its prepared corpus")
        defaults = dict(DEMO_DEFAULTS)
        if cfg.checkpoint.save is None and cfg.checkpoint.load is None:  # the demo command resumes its own run
            defaults["checkpoint"] = {**defaults["checkpoint"], "load": defaults["checkpoint"]["save"]}
        if cfg.training.train_samples is not None or cfg.training.train_flops is not None:
            defaults["training"] = {k: v for k, v in defaults["training"].items() if k != "train_iters"}
        cfg = cfg.replace(data={"data_path": [demo_corpus["data_prefix"]],
                                "valid_data_path": [demo_corpus["valid_prefix"]]},
                          tokenizer={"tokenizer_type": demo_corpus["tokenizer_type"],
                                     "tokenizer_model": demo_corpus["tokenizer_model"]})
        cfg = _fill(cfg, defaults)
    else:
        if not (cfg.tokenizer.tokenizer_type and cfg.tokenizer.tokenizer_model):
            raise InputError("--data-path needs --tokenizer-type and --tokenizer-model (the tokenizer "
                             "the data was preprocessed with)")
        cfg = _fill(cfg, DEFAULTS)
    if cfg.optimizer.min_lr is None:
        cfg = cfg.replace(optimizer={"min_lr": cfg.optimizer.lr / 10})
    return cfg


def resolve_iterations(cfg: RunConfig, vocab_size: int) -> RunConfig:
    """--train-iters from --train-flops (rounded down: a run never exceeds its budget) or
    --train-samples (rounded up to whole global batches)."""
    from megatron_dllm.scaling.flops import train_flops_per_sequence
    from megatron_dllm.scaling.plan import iterations_for_budget

    t = cfg.training
    if t.train_flops is not None:
        per_sequence = train_flops_per_sequence(cfg.preset(), vocab_size, cfg.model.backbone_length(),
                                                t.flops_convention)
        iters = iterations_for_budget(t.train_flops, per_sequence, t.global_batch_size)
        if iters < 1:
            raise InputError(f"--train-flops {t.train_flops:g} pays for no iteration: one costs "
                             f"{per_sequence * t.global_batch_size:.4g} FLOPs ({t.flops_convention}) "
                             f"at --global-batch-size {t.global_batch_size}")
        return cfg.replace(training={"train_iters": iters})
    if t.train_iters is None:
        if t.train_samples is None:
            raise InputError("give --train-iters, --train-samples or --train-flops")
        return cfg.replace(training={"train_iters": math.ceil(t.train_samples / t.global_batch_size)})
    return cfg
