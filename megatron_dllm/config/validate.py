"""Every rule that involves two or more flags, in one place: `validate(config) -> config`.

A flag's own form (a positive integer, a fraction, a known choice, a data-path blend) is checked
when it is parsed (`fields.py`, `run.parse_flags`); whether flags fit together is checked here,
and nowhere else. Every command that builds a run configuration validates it before any work:

    config = parse_args(argv)                                   # parse_flags + validate
    config = validate(resolve_defaults(config), world_size)     # defaults filled, the launch known
    ...
    config = validate(resolve_iterations(config, vocab_size), world_size)   # the final configuration

`validate` takes a configuration at any stage of resolution. A rule whose operand is still unset
(None: neither given nor resolved yet) waits for the stage that sets it, so the final, resolved
configuration (the one logged and written as run_config.yaml) has passed every rule. Resolution
never contradicts a rule: it fills what was not given and turns --train-samples, --train-flops,
--train-epochs and --train-data-path into --train-iters and --data-path, clearing them.

`world_size` (the launch's) is given on the machine that runs the command; then the rules about
the launch apply too: the world size against the layout and the batch, and this machine's
TransformerEngine and apex kernels. Flags checked ahead of a launch (`parse_args`, `relaunch`)
leave it None.

Each rule is a function of (config, world_size) that raises one-line `InputError`s naming the
flags; `RULES` lists them in the order they are checked. Three checks also serve other callers:
`check_tokenizer_options` (`TokenizerConfig.options()`, for the commands that take tokenizer flags
without a run configuration), `check_budget` (`resolve_iterations`, which alone knows the
vocabulary) and `Preset.check_layout` (`model/presets.py`, below this package, so that the
converters writing a chosen layout share it); `layout` calls the last.
"""
from __future__ import annotations

from megatron_dllm.errors import InputError


def validate(config, world_size: int | None = None):
    """`config` (a RunConfig) unchanged if every rule holds, else the first broken rule's InputError."""
    for rule in RULES:
        rule(config, world_size)
    return config


# ------------------------------------------------------------------ data and tokenizer


def data_paths(config, world_size=None) -> None:
    data = config.data
    for flag, value in (("--data-path", data.data_path), ("--train-data-path", data.train_data_path),
                        ("--valid-data-path", data.valid_data_path)):
        if value == []:  # a flag left without its value: never "no data"
            raise InputError(f"{flag} has no value; give a dataset prefix, or weights and prefixes")
    if data.train_data_path is not None and (data.data_path is not None or data.valid_data_path is None):
        raise InputError("--train-data-path goes with --valid-data-path and replaces --data-path")
    if config.demo and data.valid_data_path is not None:  # the demo would replace it with its own
        raise InputError("--valid-data-path needs --data-path or --train-data-path (without them the run is the "
                         "embedded demo, which brings its own validation data); to score a dataset X alone give "
                         "--data-path X --split 0,100,0")
    if data.split != type(data).split and (data.valid_data_path is not None or config.demo):  # it would be unused
        whose = " (the embedded demo brings its own)" if config.demo else ""
        raise InputError(f"--split {data.split} carves the validation data out of --data-path; with "
                         f"--valid-data-path{whose} the validation data is that blend and --split is unused: drop "
                         f"one of them")


def tokenizer_with_data(config, world_size=None) -> None:
    tokenizer = config.tokenizer
    if config.demo:
        if tokenizer.tokenizer_type or tokenizer.tokenizer_model:
            raise InputError("--tokenizer-type/--tokenizer-model need --data-path (the embedded demo "
                             "brings its own tokenizer)")
    elif not (tokenizer.tokenizer_type and tokenizer.tokenizer_model):
        raise InputError("--data-path needs --tokenizer-type and --tokenizer-model (the tokenizer "
                         "the data was preprocessed with)")


def tokenizer_options(config, world_size=None) -> None:
    check_tokenizer_options(config.tokenizer)


def check_tokenizer_options(tokenizer) -> None:
    """The TikTokenizer-only flags (`TokenizerConfig.options()`, also checked by the commands that
    take tokenizer flags without a run configuration: preprocessing, sampling, evaluation)."""
    given = {"tiktoken-pattern": tokenizer.tiktoken_pattern,
             "tiktoken-special-tokens": tokenizer.tiktoken_special_tokens,
             "tiktoken-num-special-tokens": tokenizer.tiktoken_num_special_tokens,
             "tokenizer-special-tokens": tokenizer.tokenizer_special_tokens, "vocab-size": tokenizer.vocab_size}
    if tokenizer.tokenizer_type != "TikTokenizer":
        names = [name for name, value in given.items() if value is not None]
        if names:
            raise InputError(f"--{names[0]} applies to --tokenizer-type TikTokenizer only")
    elif tokenizer.tiktoken_special_tokens is not None and tokenizer.tokenizer_special_tokens is not None:
        raise InputError("--tokenizer-special-tokens and --tiktoken-special-tokens: give one of them")


# ------------------------------------------------------------------ run length and schedule


def run_length(config, world_size=None) -> None:
    training = config.training
    if training.train_iters is not None and training.train_samples is not None:
        raise InputError("give --train-iters or --train-samples, not both")
    if training.train_flops is not None and (training.train_iters is not None or training.train_samples is not None):
        raise InputError("--train-flops sets the number of iterations; give it without --train-iters/--train-samples")
    if training.train_epochs is not None:
        if not training.sft:
            raise InputError("--train-epochs applies to --sft runs (epochs over the SFT rows); pretraining "
                             "uses --train-iters, --train-samples or --train-flops")
        if training.train_iters or training.train_samples or training.train_flops:
            raise InputError("--train-epochs sets the run length; give it without --train-iters/--train-samples/"
                             "--train-flops")


def sft_data(config, world_size=None) -> None:
    if config.training.sft and config.demo:
        raise InputError("--sft needs --data-path: an SFT dataset written by tools/preprocess_sft_data.py")


def check_budget(train_flops: float, flops_per_iteration: float, iterations: int, convention: str,
                 global_batch_size: int) -> None:
    """--train-flops against the size of one iteration (`resolve_iterations`, which knows the
    tokenizer's vocabulary, computes both)."""
    if iterations < 1:
        raise InputError(f"--train-flops {train_flops:g} pays for no iteration: one costs "
                         f"{flops_per_iteration:.4g} FLOPs ({convention}) at --global-batch-size {global_batch_size}")


def warmup_flags(config, world_size=None) -> None:
    optimizer = config.optimizer
    if optimizer.lr_warmup_iters is not None and optimizer.lr_warmup_fraction is not None:
        raise InputError("give one of --lr-warmup-iters and --lr-warmup-fraction, not both")
    if optimizer.lr_warmup_min_iters and optimizer.lr_warmup_iters is not None:
        raise InputError("--lr-warmup-min-iters bounds --lr-warmup-fraction; give it without --lr-warmup-iters")
    for name in ("lr_wsd_decay_iters", "lr_wsd_decay_style"):
        if getattr(optimizer, name) is not None and optimizer.lr_decay_style != "WSD":
            raise InputError(f"--{name.replace('_', '-')} applies to --lr-decay-style WSD, not "
                             f"{optimizer.lr_decay_style}")


def lr_range(config, world_size=None) -> None:
    optimizer = config.optimizer
    if optimizer.lr is not None and optimizer.min_lr is not None and optimizer.min_lr > optimizer.lr:
        raise InputError(f"--min-lr {optimizer.min_lr} is above --lr {optimizer.lr}: the schedule decays from "
                         f"--lr down to --min-lr")


def needs_save(config, world_size=None) -> None:
    """The flags that say when or how --save saves, refused without it: a run that forgot --save
    would otherwise end with nothing to resume from, nothing said."""
    training, ckpt = config.training, config.checkpoint
    if ckpt.save or config.demo:  # the demo saves to its default --save
        return
    exits = [flag for flag, value in (("--exit-interval", training.exit_interval),
                                      ("--exit-duration-in-mins", training.exit_duration_in_mins),
                                      ("--exit-signal-handler", training.exit_signal_handler)) if value]
    if exits:
        raise InputError(f"{exits[0]} saves a checkpoint to resume from before it exits: give --save DIR")
    saves = [flag for flag, value in (("--save-interval", ckpt.save_interval is not None),
                                      ("--async-save", ckpt.async_save),
                                      ("--keep-last-n-checkpoints", ckpt.keep_last_n_checkpoints is not None),
                                      ("--keep-checkpoint-interval", ckpt.keep_checkpoint_interval is not None))
             if value]
    if saves:
        raise InputError(f"{saves[0]} says how checkpoints are written, but no --save DIR is given to write them")


def retention(config, world_size=None) -> None:
    ckpt = config.checkpoint
    if ckpt.keep_checkpoint_interval is not None and ckpt.keep_last_n_checkpoints is None:
        raise InputError("--keep-checkpoint-interval keeps checkpoints that --keep-last-n-checkpoints would remove; "
                         "without it every checkpoint is kept: give --keep-last-n-checkpoints N")


def load_options(config, world_size=None) -> None:
    """The flags that say how --load loads, refused without it: a run that forgot --load would
    otherwise train from random weights with nothing said."""
    ckpt = config.checkpoint
    given = [flag for flag, value in (("--finetune", ckpt.finetune), ("--ckpt-step", ckpt.ckpt_step is not None),
                                      ("--no-load-optim", ckpt.no_load_optim), ("--no-load-rng", ckpt.no_load_rng))
             if value]
    if given and not ckpt.load:
        raise InputError(f"{given[0]} needs --load (the checkpoint it applies to); without it the run starts from "
                         f"random weights")


def pretrained_checkpoint(config, world_size=None) -> None:
    ckpt = config.checkpoint
    if ckpt.pretrained_checkpoint is None:
        return
    if not ckpt.load:
        raise InputError("--pretrained-checkpoint needs --load (the run's own --save): the run resumes from it once "
                         "it holds a checkpoint")
    for flag, given in (("--finetune", ckpt.finetune), ("--ckpt-step", ckpt.ckpt_step is not None)):
        if given:
            raise InputError(f"--pretrained-checkpoint with {flag}: the pretrained checkpoint is loaded as --finetune "
                             f"loads (name one of its iterations by its iter_XXXXXXX directory), and --load is "
                             f"resumed at its last checkpoint; drop {flag}")


def schedule_on_resume(config, world_size=None) -> None:
    ckpt = config.checkpoint
    if ckpt.override_opt_param_scheduler and ckpt.use_checkpoint_opt_param_scheduler:
        raise InputError("--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler contradict each "
                         "other: give one (the run's optimizer settings, or the checkpoint's)")


def warmup_before_decay(config, world_size=None) -> None:
    optimizer, train_iters = config.optimizer, config.training.train_iters
    decay = optimizer.lr_decay_iters or train_iters
    if decay is None:
        return  # the run length is resolved later
    warmup_iters = optimizer.warmup_iters(decay)
    if warmup_iters >= decay:
        raise InputError(f"LR warmup ({warmup_iters:g} iterations from --lr-warmup-iters/--lr-warmup-fraction) "
                         f"must be shorter than the decay ({decay} iterations, --lr-decay-iters or "
                         f"--train-iters)")
    wsd = optimizer.lr_wsd_decay_iters
    if optimizer.lr_decay_style == "WSD" and wsd is not None and wsd > decay - warmup_iters:
        raise InputError(f"--lr-wsd-decay-iters {wsd} is longer than the iterations between the warmup's end "
                         f"({warmup_iters:g}) and the end of the decay ({decay}, --lr-decay-iters or --train-iters): "
                         f"the final decay would begin before the warmup ends")


# ------------------------------------------------------------------ model


def family_loss(config, world_size=None) -> None:
    from megatron_dllm.families import FAMILIES

    FAMILIES[config.model.family].check_loss(config.model.loss)


def family_settings(config, world_size=None) -> None:
    """A family's own flags (BD3-LM's --block-size, --noise, ...) go with that family, which
    checks them (`Family.options_from_flags`, through `ModelConfig.family_options`); --shift is
    MDLM's: Eso-LM's order is shuffled and AR already predicts the next token."""
    from megatron_dllm.families import FAMILIES

    config.model.family_options()
    if config.backbone.shift and config.model.family != "mdlm":
        raise InputError(f"--shift applies to --family mdlm, not {config.model.family}")
    if config.data.variable_seq_length_prob:  # a cut of the sequence: whole blocks, and SFT's responses, get lost
        if not FAMILIES[config.model.family].variable_length:
            raise InputError(f"--variable-seq-length-prob does not apply to --family {config.model.family}: its "
                             f"samples keep their full length (AR's as in the reference, BD3-LM's whole blocks)")
        if config.training.sft:
            raise InputError("--variable-seq-length-prob with --sft: a cut shorter than a row's prompt leaves no "
                             "response token to train on (SFT rows have their own lengths)")


def attention_anneal(config, world_size=None) -> None:
    """--attention-mask-anneal-iters opens a causal mask into MDLM's and Duo's bidirectional attention,
    and the mask is an explicit boolean one: megatron-core's local core attention and SDPA take it,
    TransformerEngine's backends here do not (their layers get the layout's mask type)."""
    from megatron_dllm.families import FAMILIES

    model = config.model
    if model.attention_mask_anneal_iters is None:
        return
    if FAMILIES[model.family].attention != "bidirectional":
        raise InputError(f"--attention-mask-anneal-iters applies to the bidirectional families (--family mdlm, duo), "
                         f"not {model.family}")
    backend = model.attention_backend or ("auto" if model.uses_te() else "local")
    if backend not in ("local", "sdpa"):
        raise InputError(f"--attention-mask-anneal-iters needs --attention-backend sdpa or local (an explicit "
                         f"boolean mask), not {backend}")


def backbone(config, world_size=None) -> None:
    """The GPT backbone's flags go with --backbone gpt and with each other (`BackboneConfig.gpt_shape`)."""
    if config.model.preset is not None:
        config.gpt_shape()


def recompute(config, world_size=None) -> None:
    model = config.model
    granularity = model.recompute_granularity or ("selective" if model.recompute_activations else None)
    if granularity != "full" and (model.recompute_method or model.recompute_num_layers):
        raise InputError("--recompute-method/--recompute-num-layers apply to --recompute-granularity full")
    if granularity == "full" and model.recompute_method is None:
        raise InputError("--recompute-granularity full needs --recompute-method uniform|block")
    if model.recompute_modules and granularity != "selective":
        raise InputError("--recompute-modules applies to --recompute-granularity selective")
    modules = set(model.recompute_modules or ())
    if {"mlp", "mlp_act"} <= modules:
        raise InputError("--recompute-modules mlp mlp_act: mlp recomputes the whole MLP, its activation "
                         "included; pass one of them")
    released = sorted(modules & {"layernorm", "mlp_act"})
    if released and config.precision.fp8_format and config.precision.fp8_recipe == "delayed":
        raise InputError(f"--recompute-modules {' '.join(released)} with --fp8-format needs --fp8-recipe "
                         f"tensorwise, blockwise or mxfp8: it releases inputs that TransformerEngine's linears "
                         f"must then keep unquantized, which delayed scaling does not support (megatron-core "
                         f"refuses it too)")
    if "layernorm" not in modules:
        return
    from megatron_dllm import platform

    gpt = config.backbone.backbone == "gpt" or (model.preset is not None and config.gpt_shape() is not None)
    if gpt and not platform.HAS_TE:
        raise InputError("--recompute-modules layernorm with the GPT backbone needs TransformerEngine installed: "
                         "megatron-core's TransformerLayer recomputes its norms through a checkpoint that reads "
                         "TransformerEngine's FP8 state (the DiT's layer does not)")


# ------------------------------------------------------------------ parallel layout


def sequence_parallel(config, world_size=None) -> None:
    tp, seq_length = config.parallel.tensor_model_parallel_size, config.model.seq_length
    if config.parallel.sequence_parallel and seq_length and seq_length % tp:
        raise InputError(f"--seq-length {seq_length} must be a multiple of --tensor-model-parallel-size {tp} "
                         f"under --sequence-parallel")


def layout(config, world_size=None) -> None:
    parallel = config.parallel
    pp, vpp = parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_model_parallel_size
    if vpp is not None and pp < 2:
        raise InputError(f"--virtual-pipeline-model-parallel-size {vpp} needs --pipeline-model-parallel-size > 1 "
                         f"(it interleaves the pipeline's stages)")
    if config.model.preset is not None:
        preset = config.preset()
        preset.check_layout(parallel.tensor_model_parallel_size, pp, vpp)
        shape = config.gpt_shape()
        if shape is not None:
            shape.check_layout(preset.num_attention_heads, parallel.tensor_model_parallel_size)
            _gpt_recompute_groups(config, preset.num_layers // (pp * (vpp or 1)))


def _gpt_recompute_groups(config, layers_per_chunk: int) -> None:
    """megatron-core's TransformerBlock checkpoints uniform groups of --recompute-num-layers
    without clipping the last one (the DiT's block clips it): they must fill each chunk exactly."""
    model = config.model
    group = model.recompute_num_layers or 1
    if model.recompute_method == "uniform" and layers_per_chunk % group:
        raise InputError(f"--recompute-method uniform --recompute-num-layers {group} with the GPT backbone: the "
                         f"{layers_per_chunk} layers of each pipeline stage (or virtual stage) must split into whole "
                         f"groups of {group}")


# ------------------------------------------------------------------ the launch


def batch(config, world_size=None) -> None:
    """The global batch splits into micro-batches over the data-parallel ranks (without the
    launch's world size: over one rank)."""
    parallel, training = config.parallel, config.training
    model_parallel = parallel.tensor_model_parallel_size * parallel.pipeline_model_parallel_size
    if world_size is not None and world_size % model_parallel:
        raise InputError(f"--tensor-model-parallel-size {parallel.tensor_model_parallel_size} x "
                         f"--pipeline-model-parallel-size {parallel.pipeline_model_parallel_size} = "
                         f"{model_parallel} does not divide the world size {world_size}")
    if training.global_batch_size is None or training.micro_batch_size is None:
        return
    data_parallel = 1 if world_size is None else world_size // model_parallel
    if training.global_batch_size % (training.micro_batch_size * data_parallel):
        raise InputError(f"--global-batch-size {training.global_batch_size} is not a multiple of "
                         f"--micro-batch-size {training.micro_batch_size} x data-parallel size {data_parallel}")
    pp = parallel.pipeline_model_parallel_size
    micro_batches = training.global_batch_size // (training.micro_batch_size * data_parallel)
    if world_size is not None and parallel.virtual_pipeline_model_parallel_size and micro_batches % pp:
        raise InputError(f"--virtual-pipeline-model-parallel-size: megatron-core's interleaved schedule needs the "
                         f"micro-batches per iteration ({micro_batches} = --global-batch-size "
                         f"{training.global_batch_size} / (--micro-batch-size {training.micro_batch_size} x "
                         f"data-parallel size {data_parallel})) to be a multiple of --pipeline-model-parallel-size "
                         f"{pp}")


def kernels(config, world_size=None) -> None:
    """TransformerEngine layers, FP8 and apex's fused softmax need this machine to have them."""
    if world_size is None:  # checked on the machine that runs, not ahead of the launch
        return
    from megatron_dllm import platform

    model, precision = config.model, config.precision
    use_te = model.uses_te()
    if (use_te or precision.fp8_format) and not platform.HAS_TE:
        raise InputError("--transformer-impl transformer_engine and --fp8-format need TransformerEngine "
                         "on a CUDA GPU (not found); use --transformer-impl local without FP8")
    # Only megatron-core's local core attention reads the flag: SDPA and TransformerEngine fuse the
    # softmax inside their attention kernels whatever it says.
    local_attention = (model.attention_backend or ("auto" if use_te else "local")) == "local"
    if model.masked_softmax_fusion and local_attention and not platform.fusion_defaults()["masked_softmax"]:
        raise InputError("--masked-softmax-fusion with --attention-backend local needs apex's fused softmax "
                         "kernels (scaled_masked_softmax_cuda) on a CUDA GPU (not found); use --attention-backend "
                         "sdpa, whose kernels fuse the softmax, or drop the flag")


def cuda_graph(config, world_size=None) -> None:
    """Megatron-LM's CUDA-graph flags: only the full-iteration graph applies to the DiT, on a
    layout and with the features its capture has been checked with (training/cuda_graph.py)."""
    model, parallel = config.model, config.parallel
    scope = model.cuda_graph_scope or []
    if model.cuda_graph_impl == "none":
        if scope:
            raise InputError(f"--cuda-graph-scope {' '.join(scope)} needs --cuda-graph-impl local")
        return
    if model.cuda_graph_impl != "local" or scope != ["full_iteration"]:
        raise InputError(f"--cuda-graph-impl {model.cuda_graph_impl} --cuda-graph-scope {' '.join(scope) or '(none)'}: "
                         f"per-layer CUDA graphs (megatron-core's and TransformerEngine's) capture megatron-core's "
                         f"TransformerLayer, not the DiT's layer; use --cuda-graph-impl local --cuda-graph-scope "
                         f"full_iteration")
    refused = {
        "--tensor-model-parallel-size > 1": parallel.tensor_model_parallel_size > 1,
        "--pipeline-model-parallel-size > 1": parallel.pipeline_model_parallel_size > 1,
        "--overlap-grad-reduce": parallel.overlap_grad_reduce,
        "TransformerEngine layers (give --transformer-impl local)":
            model.transformer_impl == "transformer_engine" or config.precision.fp8_format is not None
            or (world_size is not None and model.uses_te()),
        "activation recompute": bool(model.recompute().get("recompute_granularity")),
    }
    clash = [name for name, given in refused.items() if given]
    if clash:
        raise InputError(f"--cuda-graph-scope full_iteration does not support {', '.join(clash)}: the graph runs "
                         f"one device's forward and backward, with data-parallel gradient reduction after it")
    if world_size is not None:
        from megatron_dllm import platform

        if not platform.HAS_CUDA:
            raise InputError("--cuda-graph-impl local --cuda-graph-scope full_iteration needs a CUDA GPU (none found)")


# ------------------------------------------------------------------ logging


def profile(config, world_size=None) -> None:
    logging = config.logging
    demo_tensorboard = config.demo and config.checkpoint.save is None  # the demo run's own (config/run.py)
    if logging.profile and (logging.profile_step_end <= logging.profile_step_start
                            or not logging.tensorboard_dir and not demo_tensorboard):
        raise InputError("--profile needs --profile-step-end > --profile-step-start and a --tensorboard-dir for "
                         "its traces")
    for rank in logging.profile_ranks or [] if logging.profile else []:
        if rank < 0 or world_size and rank >= world_size:
            raise InputError(f"--profile-ranks {rank}: this run has ranks 0-" + (f"{world_size - 1}" if world_size
                                                                                 else "(its world size - 1)"))


RULES = (data_paths, sequence_parallel, sft_data, run_length, warmup_flags, lr_range, needs_save, retention,
         pretrained_checkpoint, load_options, schedule_on_resume, recompute, profile, tokenizer_with_data,
         tokenizer_options, family_loss, family_settings, attention_anneal, backbone, layout, batch, kernels,
         cuda_graph, warmup_before_decay)
