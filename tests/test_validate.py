"""config/validate.py: every rule between flags is raised by `validate` itself (parsing alone
accepts the same flags), a configuration that keeps the rules passes at every stage of
resolution, and the run_config.yaml a run writes is its resolved configuration, read back equal."""
import pytest
from conftest import TINY_RUN

from megatron_dllm import platform
from megatron_dllm.config import parse_args, parse_flags, resolve_defaults, resolve_iterations, validate
from megatron_dllm.config.validate import RULES
from megatron_dllm.config.yaml_config import write_resolved
from megatron_dllm.errors import InputError

DATA = ["--data-path", "/d/x_text_document", "--tokenizer-type", "SentencePieceTokenizer",
        "--tokenizer-model", "t.model"]
DEMO = {"data_prefix": "/demo/train_text_document", "valid_prefix": "/demo/valid_text_document",
        "tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": "/demo/bpe.model"}
NO_TE = "--transformer-impl transformer_engine and --fp8-format need TransformerEngine"
NO_APEX = "--masked-softmax-fusion with --attention-backend local needs apex's fused softmax"

# (rule, flags, world size (None: ahead of the launch), resolve defaults first, the message)
CASES = [
    ("data_paths", ["--train-data-path", "/d/a"], None, False,
     "--train-data-path goes with --valid-data-path and replaces --data-path"),
    ("data_paths", [*DATA, "--train-data-path", "/d/a", "--valid-data-path", "/d/b"], None, False,
     "--train-data-path goes with --valid-data-path and replaces --data-path"),
    ("data_paths", [*DATA, "--valid-data-path"], None, False,
     "--valid-data-path has no value; give a dataset prefix, or weights and prefixes"),
    ("sequence_parallel", ["--sequence-parallel", "--tensor-model-parallel-size", "2", "--seq-length", "33"], None,
     False, "--seq-length 33 must be a multiple of --tensor-model-parallel-size 2 under --sequence-parallel"),
    ("run_length", ["--train-iters", "3", "--train-samples", "24"], None, False,
     "give --train-iters or --train-samples, not both"),
    ("run_length", ["--train-flops", "6e18", "--train-iters", "3"], None, False,
     "--train-flops sets the number of iterations; give it without --train-iters/--train-samples"),
    ("run_length", ["--train-epochs", "1"], None, False, "--train-epochs applies to --sft runs"),
    ("run_length", [*DATA, "--sft", "--train-epochs", "1", "--train-iters", "5"], None, False,
     "--train-epochs sets the run length; give it without --train-iters/--train-samples/--train-flops"),
    ("warmup_flags", ["--lr-warmup-min-iters", "100", "--lr-warmup-iters", "5"], None, False,
     "--lr-warmup-min-iters bounds --lr-warmup-fraction; give it without --lr-warmup-iters"),
    ("warmup_flags", ["--lr-warmup-iters", "10", "--lr-warmup-fraction", "0.5"], None, False,
     "give one of --lr-warmup-iters and --lr-warmup-fraction, not both"),  # Megatron-LM refuses both too
    ("warmup_flags", ["--lr-wsd-decay-iters", "10"], None, False,
     "--lr-wsd-decay-iters applies to --lr-decay-style WSD, not cosine"),
    ("warmup_flags", ["--lr-decay-style", "linear", "--lr-wsd-decay-style", "cosine"], None, False,
     "--lr-wsd-decay-style applies to --lr-decay-style WSD, not linear"),
    ("retention", ["--save", "/s", "--keep-checkpoint-interval", "10"], None, False,
     "--keep-checkpoint-interval keeps checkpoints that --keep-last-n-checkpoints would remove"),
    ("recompute", ["--recompute-granularity", "full"], None, False,
     "--recompute-granularity full needs --recompute-method uniform|block"),
    ("recompute", ["--recompute-activations", "--recompute-num-layers", "2"], None, False,
     "--recompute-method/--recompute-num-layers apply to --recompute-granularity full"),
    ("recompute", ["--recompute-modules", "mlp"], None, False,
     "--recompute-modules applies to --recompute-granularity selective"),
    ("recompute", ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-modules",
                   "layernorm"], None, False, "--recompute-modules applies to --recompute-granularity selective"),
    ("recompute", ["--recompute-activations", "--recompute-modules", "mlp_act", "mlp"], None, False,
     "--recompute-modules mlp mlp_act: mlp recomputes the whole MLP, its activation included; pass one of them"),
    ("recompute", ["--recompute-activations", "--recompute-modules", "mlp_act", "layernorm", "--fp8-format", "hybrid"],
     None, False, "--recompute-modules layernorm mlp_act with --fp8-format needs --fp8-recipe tensorwise, blockwise "
     "or mxfp8: it releases inputs that TransformerEngine's linears must then keep unquantized, which delayed "
     "scaling does not support (megatron-core refuses it too)"),
    ("recompute", ["--backbone", "gpt", "--recompute-activations", "--recompute-modules", "layernorm"], None, False,
     "--recompute-modules layernorm with the GPT backbone needs TransformerEngine installed: megatron-core's "
     "TransformerLayer recomputes its norms through a checkpoint that reads TransformerEngine's FP8 state (the "
     "DiT's layer does not)"),
    ("profile", [*DATA, "--profile"], None, False,
     "--profile needs --profile-step-end > --profile-step-start and a --tensorboard-dir"),
    ("profile", ["--profile", "--profile-step-start", "5", "--profile-step-end", "5"], None, False,
     "--profile needs --profile-step-end > --profile-step-start"),
    ("profile", ["--profile", "--profile-step-start", "2", "--profile-step-end", "4", "--profile-ranks", "3"], 2,
     False, "--profile-ranks 3: this run has ranks 0-1"),
    ("profile", ["--profile", "--profile-step-start", "2", "--profile-step-end", "4", "--profile-ranks", "-1"], None,
     False, "--profile-ranks -1: this run has ranks 0-"),
    ("profile", ["--profile", "--save", "/s"], None, False,  # a demo run of its own has no default TensorBoard
     "--profile needs --profile-step-end > --profile-step-start and a --tensorboard-dir"),
    ("tokenizer_with_data", ["--tokenizer-model", "t.model"], None, False,
     "--tokenizer-type/--tokenizer-model need --data-path (the embedded demo brings its own tokenizer)"),
    ("tokenizer_with_data", ["--data-path", "/d/x_text_document"], None, False,
     "--data-path needs --tokenizer-type and --tokenizer-model"),
    ("tokenizer_options", [*DATA, "--vocab-size", "1000"], None, False,
     "--vocab-size applies to --tokenizer-type TikTokenizer only"),
    ("tokenizer_options", ["--data-path", "/d/x", "--tokenizer-type", "TikTokenizer", "--tokenizer-model", "v.json",
                           "--tokenizer-special-tokens", "<unk>", "--tiktoken-special-tokens", "<s>"], None, False,
     "--tokenizer-special-tokens and --tiktoken-special-tokens: give one of them"),
    ("sft_data", ["--sft", "--train-iters", "5"], None, False, "--sft needs --data-path: an SFT dataset"),
    ("family_settings", ["--family", "mdlm", "--block-size", "4"], None, False,
     "--block-size applies to --family bd3lm only (this run: --family mdlm)"),
    # a run_config.yaml would record them as applied
    ("data_paths", ["--valid-data-path", "/d/v"], None, False,
     "--valid-data-path needs --data-path or --train-data-path (without them the run is the embedded demo"),
    ("data_paths", [*DATA, "--valid-data-path", "/d/v", "--split", "0,100,0"], None, False,
     "--split 0,100,0 carves the validation data out of --data-path; with --valid-data-path the validation data is "
     "that blend and --split is unused: drop one of them"),
    ("load_options", [*DATA, "--save", "/s", "--finetune"], None, False,
     "--finetune needs --load (the checkpoint it applies to); without it the run starts from random weights"),
    ("load_options", [*DATA, "--ckpt-step", "5", "--no-load-optim"], None, False, "--ckpt-step needs --load"),
    ("load_options", [*DATA, "--no-load-rng"], None, False, "--no-load-rng needs --load"),
    ("family_settings", ["--family", "mdlm", "--noise", "uniform"], None, False,
     "--noise applies to --family bd3lm only (this run: --family mdlm)"),
    ("family_settings", ["--family", "esolm", "--sampling-eps-min", "0.5"], None, False,
     "--sampling-eps-min applies to --family bd3lm only (this run: --family esolm)"),
    ("family_settings", ["--family", "duo", "--sampling-eps-max", "0.9"], None, False,
     "--sampling-eps-max applies to --family bd3lm only (this run: --family duo)"),
    ("family_settings", ["--family", "bd3lm"], None, False, "--family bd3lm needs --block-size"),
    ("family_settings", ["--family", "bd3lm", "--block-size", "5", "--seq-length", "128"], None, False,
     "--block-size 5 must divide --seq-length 128"),
    ("family_settings", ["--family", "ar", "--shift"], None, False, "--shift applies to --family mdlm, not ar"),
    ("family_settings", ["--family", "bd3lm", "--block-size", "4", "--variable-seq-length-prob", "0.5"], None, False,
     "--variable-seq-length-prob does not apply to --family bd3lm: its samples keep their full length"),
    ("family_settings", [*DATA, "--sft", "--variable-seq-length-prob", "0.5"], None, False,
     "--variable-seq-length-prob with --sft: a cut shorter than a row's prompt leaves no response token"),
    ("family_settings", ["--family", "bd3lm", "--block-size", "4", "--sampling-eps-min", "0.6",
                         "--sampling-eps-max", "0.5"], None, False, "need 0 < min <= max <= 1"),
    ("attention_anneal", ["--family", "esolm", "--attention-mask-anneal-iters", "100"], None, False,
     "--attention-mask-anneal-iters applies to the bidirectional families (--family mdlm, duo), not esolm"),
    ("attention_anneal", ["--attention-mask-anneal-iters", "100", "--attention-backend", "flash"], None, False,
     "--attention-mask-anneal-iters needs --attention-backend sdpa or local (an explicit boolean mask), not flash"),
    ("backbone", ["--swiglu"], None, True, "--swiglu applies to --backbone gpt (this run trains the DiT)"),
    ("backbone", ["--backbone", "gpt", "--num-query-groups", "2"], None, True,
     "--num-query-groups needs --group-query-attention"),
    ("family_loss", ["--family", "esolm", "--loss", "sequential"], None, False,
     "--loss sequential is not available for --family esolm"),
    ("family_loss", ["--family", "ar", "--loss", "low-var"], None, False,
     "--loss low-var is not available for --family ar; valid: nll"),
    ("family_loss", ["--family", "duo", "--loss", "low-var"], None, False,
     "--loss low-var is not available for --family duo; valid: nelbo"),
    ("layout", ["--virtual-pipeline-model-parallel-size", "2"], None, False,
     "--virtual-pipeline-model-parallel-size 2 needs --pipeline-model-parallel-size > 1"),
    ("layout", ["--preset", "cpu-tiny", "--tensor-model-parallel-size", "2", "--num-attention-heads", "3"], None,
     False, "--tensor-model-parallel-size 2 does not divide the number of attention heads 3 of this preset"),
    ("layout", ["--tensor-model-parallel-size", "3"], None, True,  # the demo's default preset, cpu-small: 4 heads
     "--tensor-model-parallel-size 3 does not divide the number of attention heads 4 of this preset"),
    ("layout", ["--preset", "cpu-tiny", "--pipeline-model-parallel-size", "2",
                "--virtual-pipeline-model-parallel-size", "2"], None, False,
     "--pipeline-model-parallel-size 2 x --virtual-pipeline-model-parallel-size 2 = 4 does not divide the 2 layers"),
    ("batch", ["--tensor-model-parallel-size", "2"], 3, False,
     "--tensor-model-parallel-size 2 x --pipeline-model-parallel-size 1 = 2 does not divide the world size 3"),
    ("batch", ["--micro-batch-size", "4", "--global-batch-size", "6"], None, False,
     "--global-batch-size 6 is not a multiple of --micro-batch-size 4 x data-parallel size 1"),
    ("batch", ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size",
               "2", "--micro-batch-size", "2", "--global-batch-size", "6"], 2, False,
     "megatron-core's interleaved schedule needs the micro-batches per iteration (3 = --global-batch-size 6 / "
     "(--micro-batch-size 2 x data-parallel size 1)) to be a multiple of --pipeline-model-parallel-size 2"),
    ("batch", ["--global-batch-size", "24"], 2, True,  # the demo's default micro-batch: 8
     "--global-batch-size 24 is not a multiple of --micro-batch-size 8 x data-parallel size 2"),
    ("warmup_before_decay", ["--train-iters", "10", "--lr-warmup-iters", "10"], None, False,
     "LR warmup (10 iterations from --lr-warmup-iters/--lr-warmup-fraction) must be shorter than the decay "
     "(10 iterations"),
    ("warmup_before_decay", ["--train-iters", "100", "--lr-warmup-iters", "8", "--lr-decay-iters", "8"], None, False,
     "must be shorter than the decay (8 iterations"),
    ("warmup_before_decay", ["--train-iters", "100", "--lr-warmup-iters", "10", "--lr-decay-style", "WSD",
                             "--lr-wsd-decay-iters", "91"], None, False,
     "--lr-wsd-decay-iters 91 is longer than the iterations between the warmup's end (10) and the end of the decay "
     "(100, --lr-decay-iters or --train-iters): the final decay would begin before the warmup ends"),
    ("layout", ["--preset", "cpu-small", "--backbone", "gpt", "--recompute-granularity", "full", "--recompute-method",
                "uniform", "--recompute-num-layers", "3"], None, False,
     "--recompute-method uniform --recompute-num-layers 3 with the GPT backbone: the 4 layers of each pipeline "
     "stage (or virtual stage) must split into whole groups of 3"),
    ("layout", ["--preset", "cpu-tiny", "--backbone", "gpt", "--ffn-hidden-size", "33",
                "--tensor-model-parallel-size", "2"], None, False,
     "--tensor-model-parallel-size 2 does not divide --ffn-hidden-size 33"),
    ("needs_save", [*DATA, "--exit-interval", "10"], None, False,
     "--exit-interval saves a checkpoint to resume from before it exits: give --save DIR"),
    ("needs_save", [*DATA, "--exit-signal-handler"], None, False, "--exit-signal-handler saves a checkpoint"),
    ("needs_save", [*DATA, "--save-interval", "5"], None, False,
     "--save-interval says how checkpoints are written, but no --save DIR is given to write them"),
    ("needs_save", [*DATA, "--async-save"], None, False, "--async-save says how checkpoints are written"),
    ("needs_save", [*DATA, "--keep-last-n-checkpoints", "2"], None, False, "--keep-last-n-checkpoints says how"),
    ("pretrained_checkpoint", ["--pretrained-checkpoint", "/p"], None, False,
     "--pretrained-checkpoint needs --load (the run's own --save)"),
    ("pretrained_checkpoint", ["--pretrained-checkpoint", "/p", "--load", "/s", "--finetune"], None, False,
     "--pretrained-checkpoint with --finetune: the pretrained checkpoint is loaded as --finetune loads"),
    ("pretrained_checkpoint", ["--pretrained-checkpoint", "/p", "--load", "/s", "--ckpt-step", "3"], None, False,
     "drop --ckpt-step"),
    ("schedule_on_resume", ["--override-opt-param-scheduler", "--use-checkpoint-opt_param-scheduler"], None, False,
     "--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler contradict each other"),
    ("lr_range", ["--lr", "1e-4", "--min-lr", "1e-3"], None, False,
     "--min-lr 0.001 is above --lr 0.0001: the schedule decays from --lr down to --min-lr"),
    ("lr_range", ["--min-lr", "2e-3"], None, True, "--min-lr 0.002 is above --lr 0.001"),  # the demo's default --lr
    ("layout", ["--preset", "cpu-tiny", "--hidden-size", "66"], None, False,
     "--hidden-size 66 is not a multiple of --num-attention-heads 4: every head takes hidden-size / heads channels"),
    ("layout", ["--preset", "cpu-tiny", "--hidden-size", "36"], None, False,
     "--hidden-size 36 / --num-attention-heads 4 = 9 channels per head: rotary embeddings need an even number"),
]
GRAPH = ["--cuda-graph-impl", "local", "--cuda-graph-scope", "full_iteration"]
UNSUPPORTED = "--cuda-graph-scope full_iteration does not support "
CASES += [
    ("cuda_graph", ["--cuda-graph-scope", "full_iteration"], None, False,
     "--cuda-graph-scope full_iteration needs --cuda-graph-impl local"),
    ("cuda_graph", ["--cuda-graph-impl", "local"], None, False,
     "per-layer CUDA graphs (megatron-core's and TransformerEngine's) capture megatron-core's TransformerLayer"),
    ("cuda_graph", ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn"], None, False,
     "use --cuda-graph-impl local --cuda-graph-scope full_iteration"),
    ("cuda_graph", [*GRAPH, "--preset", "cpu-tiny", "--tensor-model-parallel-size", "2"], None, False,
     UNSUPPORTED + "--tensor-model-parallel-size > 1"),
    ("cuda_graph", [*GRAPH, "--preset", "cpu-tiny", "--pipeline-model-parallel-size", "2"], None, False,
     UNSUPPORTED + "--pipeline-model-parallel-size > 1"),
    ("cuda_graph", [*GRAPH, "--overlap-grad-reduce", "--recompute-activations"], None, False,
     UNSUPPORTED + "--overlap-grad-reduce, activation recompute"),
    ("cuda_graph", [*GRAPH, "--transformer-impl", "transformer_engine"], None, False,
     UNSUPPORTED + "TransformerEngine layers (give --transformer-impl local)"),
]
if not platform.HAS_CUDA:
    CASES += [("cuda_graph", GRAPH, 1, False, "--cuda-graph-impl local --cuda-graph-scope full_iteration needs a CUDA "
                                              "GPU (none found)")]
if not platform.HAS_TE:
    CASES += [("kernels", ["--transformer-impl", "transformer_engine"], 1, False, NO_TE),
              ("kernels", ["--fp8-format", "hybrid"], 1, False, NO_TE)]
if not platform.fusion_defaults()["masked_softmax"]:
    CASES += [("kernels", ["--masked-softmax-fusion", "--transformer-impl", "local"], 1, False, NO_APEX)]


@pytest.mark.parametrize("rule, flags, world_size, resolved, message", CASES,
                         ids=[f"{case[0]}-{i}" for i, case in enumerate(CASES)])
def test_each_rule_is_raised_by_validate(rule, flags, world_size, resolved, message):
    config = parse_flags(flags)  # each flag's own value is fine
    if resolved:
        config = resolve_defaults(config)
    with pytest.raises(InputError) as err:
        validate(config, world_size)
    assert message in str(err.value) and "\n" not in str(err.value)
    broken = []  # the rule named is the one that refuses it
    for candidate in RULES:
        try:
            candidate(config, world_size)
        except InputError:
            broken.append(candidate.__name__)
    assert rule in broken, broken


def test_train_samples_of_less_than_one_global_batch_is_refused():
    config = resolve_defaults(parse_flags(["--train-samples", "7", "--global-batch-size", "8"]), DEMO)
    with pytest.raises(InputError, match=r"^--train-samples 7 is less than one global batch \(--global-batch-size 8\)"):
        resolve_iterations(config, vocab_size=4097)


def test_split_on_the_demo_is_refused_as_unused():
    """The demo brings its own validation set, so a --split given would be silently unused."""
    with pytest.raises(InputError, match=r"--valid-data-path \(the embedded demo brings its own\)"):
        validate(parse_flags(["--split", "90,10,0"]))
    validate(resolve_defaults(parse_flags(["--split", "969,30,1"]), DEMO))  # the default, as a relaunch writes it


def test_every_rule_has_a_case():
    covered = {case[0] for case in CASES} | ({"kernels"} if platform.HAS_TE else set())
    assert {rule.__name__ for rule in RULES} <= covered


@pytest.mark.parametrize("flags, world_size", [
    ([], 1), ([], None), (DATA + ["--train-iters", "5"], 4), (["--train-data-path", "/d/a", "--valid-data-path",
                                                                "/d/b", *DATA[2:], "--train-samples", "640"], 2),
    (["--sequence-parallel", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
      "--virtual-pipeline-model-parallel-size", "2", "--global-batch-size", "64"], 8),
    (["--family", "duo", "--loss", "nelbo", "--recompute-granularity", "full", "--recompute-method", "block",
      "--lr-warmup-min-iters", "3", "--lr-warmup-fraction", "0.1", "--train-flops", "1e13"], 1),
    ([*DATA, "--sft", "--train-epochs", "2"], 2),
    (["--family", "duo", "--backbone", "gpt", "--attention-mask-anneal-iters", "10", "--attention-backend", "sdpa"], 1),
    ([*GRAPH, "--variable-seq-length-prob", "0.01"], None),  # each other length: a new capture
    (["--recompute-activations", "--recompute-modules", "layernorm", "mlp_act", "--fp8-format", "hybrid",
      "--fp8-recipe", "tensorwise"], None),  # FP8 ahead of the launch (which needs TransformerEngine)
])
def test_a_good_configuration_passes_at_every_stage(flags, world_size):
    config = validate(parse_flags(flags), world_size)
    config = validate(resolve_defaults(config, DEMO), world_size)
    if not config.training.sft:
        config = validate(resolve_iterations(config, vocab_size=4097), world_size)
        assert config.training.train_iters >= 1 and config.training.train_flops is None
        assert config.training.train_samples is None and config.data.train_data_path is None


@pytest.mark.parametrize("flag, value, expected", [
    ("--lr", "-1", "a finite number >= 0"), ("--min-lr", "nan", "a finite number >= 0"),
    ("--weight-decay", "-0.1", "a finite number >= 0"), ("--clip-grad", "-1", "a finite number >= 0"),
    ("--adam-beta1", "1.5", "a number in [0, 1)"), ("--adam-beta2", "1", "a number in [0, 1)"),
    ("--adam-eps", "0", "a positive finite number"), ("--seed", "-1", "an integer in [0, 2**32)"),
    ("--seed", str(2**32), "an integer in [0, 2**32)"), ("--lr-wsd-decay-iters", "0", "a positive integer"),
    ("--train-epochs", "-1", "a positive finite number"), ("--loss-spike-factor", "-1", "a finite number >= 0"),
    ("--peak-flops", "0", "a positive finite number"), ("--rotary-percent", "2", "a number in (0, 1]"),
])
def test_optimizer_and_seed_values_out_of_range_are_refused_when_parsed(capsys, flag, value, expected):
    with pytest.raises(SystemExit) as exit_:
        parse_flags([flag, value])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"error: argument {flag}: expected {expected}, got {value}"]


def test_the_nan_guard_is_on_unless_turned_off_as_in_megatron_lm():
    assert parse_flags([]).training.check_for_nan_in_loss_and_grad
    assert not parse_flags(["--no-check-for-nan-in-loss-and-grad"]).training.check_for_nan_in_loss_and_grad


def test_megatron_lms_virtual_pipeline_flags(capsys):
    """--num-virtual-stages-per-pipeline-rank is ours, chunks per stage; layers per chunk are refused
    with the conversion, not an unrecognised-argument error."""
    parsed = parse_flags(["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "3"])
    assert parsed.parallel.virtual_pipeline_model_parallel_size == 3
    with pytest.raises(SystemExit) as exit_:
        parse_flags(["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage=1"])
    assert exit_.value.code == 2 and capsys.readouterr().err.startswith(
        "error: --num-layers-per-virtual-pipeline-stage: give the chunks per pipeline stage instead, "
        "--virtual-pipeline-model-parallel-size")


def test_parse_args_reports_a_broken_rule_as_one_error_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--family", "ar", "--loss", "low-var"])
    lines = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2 and lines == ["error: --loss low-var is not available for --family ar; valid: nll"]


@pytest.mark.parametrize("flags", [
    ["--family", "esolm", "--train-flops", "2e12", "--keep-last-n-checkpoints", "2", "--async-save"],
    ["--train-data-path", "/d/a", "--valid-data-path", "/d/b", *DATA[2:], "--train-samples", "1000", "--bf16",
     "--recompute-granularity", "full", "--recompute-method", "uniform", "--profile-ranks", "0", "1"],
])
def test_the_written_run_config_is_the_resolved_configuration(tmp_path, flags):
    config = validate(resolve_iterations(resolve_defaults(parse_args(flags), DEMO), vocab_size=4097), 2)
    (path,) = write_resolved(config, [str(tmp_path)], world_size=2)
    assert parse_args(["--yaml-cfg", path]) == config  # nothing added, nothing left out


def test_a_run_writes_its_validated_resolved_configuration(demo_cache, tmp_path):
    """prepare_inputs, as the trainer calls it: the configuration it returns is final (defaults,
    the demo corpus, --train-samples turned into iterations) and is what run_config.yaml holds."""
    from megatron_dllm.training.inputs import prepare_inputs

    config, _ = prepare_inputs(parse_args(["--demo-cache-dir", demo_cache, *TINY_RUN, "--train-samples", "20",
                                           "--data-cache-path", str(tmp_path / "cache")]))
    # 20 samples at 8 a global batch: 2 whole batches, rounded down as Megatron-LM (train_samples // gbs)
    assert config.training.train_iters == 2 and config.training.train_samples is None and not config.demo
    (path,) = write_resolved(config, [str(tmp_path)])
    assert validate(parse_args(["--yaml-cfg", path]), 1) == config
