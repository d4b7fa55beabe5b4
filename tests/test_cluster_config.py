"""Cluster features without a launch: --yaml-cfg against the same flags, the resolved config
read back, recompute flags as Megatron-LM derives them (and mlp_act, which megatron-core's config
does not take), which checkpoints retention keeps, the non-finite counter and loss spikes, MFU's
peak and the exit interval."""
import json
import os
import shlex

import pytest
from conftest import REPO

from megatron_dllm.checkpoint import retention
from megatron_dllm.config import parse_args, resolve_defaults, resolve_iterations
from megatron_dllm.config.training import TrainingConfig
from megatron_dllm.config.yaml_config import RESOLVED_NAME, write_resolved
from megatron_dllm.model.builder import Architecture, transformer_config
from megatron_dllm.model.gpt_shape import GPTShape
from megatron_dllm.model.presets import Preset
from megatron_dllm.training import observability
from megatron_dllm.training.exit_conditions import ExitConditions
from megatron_dllm.training.nan_guard import LossSpikes, NonFiniteCounter

FLAGS = ["--family", "duo", "--preset", "cpu-small", "--seq-length", "64", "--bf16", "--micro-batch-size", "4",
         "--global-batch-size", "32", "--train-flops", "3e12", "--lr", "3e-4", "--lr-decay-style", "WSD",
         "--data-path", "0.7", "/data/a_text_document", "0.3", "/data/b_text_document",
         "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "tok.model",
         "--save", "ckpt", "--keep-last-n-checkpoints", "3", "--exit-signal-handler",
         "--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2",
         "--profile-ranks", "0", "3", "--peak-flops", "9.89e14"]

YAML = """\
family: duo
preset: cpu-small
seq-length: 64
bf16: true
micro_batch_size: 4          # underscores work too
global-batch-size: 32
train-flops: 3.0e+12
lr-decay-style: WSD
data-path: [0.7, /data/a_text_document, 0.3, /data/b_text_document]
tokenizer-type: SentencePieceTokenizer
tokenizer-model: tok.model
checkpoint:                  # group sections, as the resolved file writes them
  save: ckpt
  keep-last-n-checkpoints: 3
training:
  exit-signal-handler: true
  sequence-parallel-never-heard-of: null
"""


def _write(tmp_path, text, name="run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_yaml_config_equals_the_same_flags(tmp_path):
    text = YAML.replace("  sequence-parallel-never-heard-of: null\n", "") + (
        "lr: 3.0e-4\nrecompute-granularity: full\nrecompute-method: block\nrecompute-num-layers: 2\n"
        "profile-ranks: [0, 3]\npeak-flops: 9.89e+14\n")
    assert parse_args(["--yaml-cfg", _write(tmp_path, text)]) == parse_args(FLAGS)


def test_command_line_flags_override_the_yaml_config(tmp_path):
    path = _write(tmp_path, "preset: cpu-small\nlr: 3.0e-4\nsave: a\n")
    cfg = parse_args(["--lr", "1e-3", "--yaml-cfg", path, "--save", "b"])
    assert (cfg.model.preset, cfg.optimizer.lr, cfg.checkpoint.save) == ("cpu-small", 1e-3, "b")
    path = _write(tmp_path, "save: -odd name\n")  # a value is a value, even one that starts with a dash
    assert parse_args(["--yaml-cfg", path]).checkpoint.save == "-odd name"


def test_an_alternative_flag_on_the_command_line_displaces_the_file_s(tmp_path):
    """--train-samples given over a file with --train-iters (a run's run_config.yaml holds the
    latter), --lr-warmup-fraction over --lr-warmup-iters: the command line wins, as for any flag,
    instead of clashing with (or silently losing to) the file's alternative."""
    path = _write(tmp_path, "preset: cpu-small\ntrain-iters: 100\nlr-warmup-iters: 10\n")
    cfg = parse_args(["--yaml-cfg", path, "--train-samples", "640", "--lr-warmup-fraction", "0.05"])
    assert (cfg.training.train_iters, cfg.training.train_samples) == (None, 640)
    assert (cfg.optimizer.lr_warmup_iters, cfg.optimizer.lr_warmup_fraction) == (None, 0.05)
    path = _write(tmp_path, "lr-warmup-fraction: 0.01\nlr-warmup-min-iters: 100\n")
    assert parse_args(["--yaml-cfg", path, "--lr-warmup-iters", "5"]).optimizer.warmup_iters(1000) == 5
    # a run_config.yaml an earlier version wrote held the default fraction beside the given iterations
    path = _write(tmp_path, "optimizer:\n  lr-warmup-iters: 10\n  lr-warmup-fraction: 0.05\nlaunch:\n  world-size: 2\n")
    assert parse_args(["--yaml-cfg", path]).optimizer.warmup_iters(1000) == 10
    # ... and the WSD shape's default of then, cosine, for every decay style (a WSD run's is its own)
    legacy = "optimizer:\n  lr-decay-style: {}\n  lr-wsd-decay-style: cosine\nlaunch:\n  world-size: 2\n"
    assert parse_args(["--yaml-cfg", _write(tmp_path, legacy.format("linear"))]).optimizer.lr_wsd_decay_style is None
    assert parse_args(["--yaml-cfg", _write(tmp_path, legacy.format("WSD"))]).optimizer.wsd_decay_style() == "cosine"
    path = _write(tmp_path, "lr-warmup-iters: 10\nlr-warmup-fraction: 0.05\n")  # a file of one's own: both refused
    with pytest.raises(SystemExit):
        parse_args(["--yaml-cfg", path])
    path = _write(tmp_path, "data-path: [0.5, -a, 0.5, b]\n")  # a list element the command line reads as a flag
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--yaml-cfg", path])
    assert exit_.value.code == 2


def test_a_yaml_value_is_read_as_written_and_a_key_may_be_any_name_of_its_flag(tmp_path):
    """YAML 1.1 would read `0755` as 493, `1.10` as 1.1 and `on` as True; a flag takes the text, as
    the command line gives it. A Megatron-LM alias and the --no-x of a switch are flags' names too."""
    path = _write(tmp_path, "save: 0755\nwandb-exp-name: 1.10\nwandb-project: on\ntrain-iters: 0100\n"
                            "no-check-for-nan-in-loss-and-grad: true\nnum-virtual-stages-per-pipeline-rank: 2\n"
                            "pipeline-model-parallel-size: 2\n")
    cfg = parse_args(["--yaml-cfg", path])
    assert (cfg.checkpoint.save, cfg.logging.wandb_exp_name, cfg.logging.wandb_project) == ("0755", "1.10", "on")
    assert parse_args(["--yaml-cfg", path]) == parse_args(
        ["--save", "0755", "--wandb-exp-name", "1.10", "--wandb-project", "on", "--train-iters", "100",
         "--no-check-for-nan-in-loss-and-grad", "--num-virtual-stages-per-pipeline-rank", "2",
         "--pipeline-model-parallel-size", "2"])


@pytest.mark.parametrize("text, message", [
    (YAML, "'sequence_parallel_never_heard_of' is not a flag of this command"),
    ("check-for-nan-in-loss-and-grad: true\nno-check-for-nan-in-loss-and-grad: false\n",
     "run.yaml:2: 'no_check_for_nan_in_loss_and_grad' is --check-for-nan-in-loss-and-grad, given already"),
    ("help: true\n", "'help' is not a flag of this command"),
    ("bf16: 3\n", "bf16 is a switch; expected true or false, got 3"),
    ("preset: [a, b]\n", "preset takes one value, got a list"),
    ("- preset\n", "expected a mapping of flag names to values, found list"),
    ("preset: [\n", "not valid YAML"),
    ("seq-length: -4\n", "--seq-length: expected a positive integer, got -4"),  # the flag's own check
    ("preset: cpu-tiny\ndata-path:\n", "run.yaml:2: --data-path has no value; give one, or leave the key out"),
    ("optimiser:\n  lr: 1.0e-3\n", "run.yaml:1: 'optimiser' is not a section of this command's flags (model,"),
])
def test_a_bad_yaml_config_is_one_error_naming_the_file(tmp_path, capsys, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--yaml-cfg", path])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_the_resolved_config_relaunches_the_same_run(tmp_path):
    demo = {"data_prefix": "/demo/train_text_document", "valid_prefix": "/demo/valid_text_document",
            "tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": "/demo/bpe.model"}
    cfg = parse_args(["--family", "esolm", "--train-flops", "2e12", "--keep-last-n-checkpoints", "2",
                      "--async-save", "--recompute-activations"])
    cfg = resolve_iterations(resolve_defaults(cfg, demo), vocab_size=4097)
    assert cfg.training.train_iters > 1
    (path,) = write_resolved(cfg, [str(tmp_path / "ckpt")], world_size=4)
    assert path == str(tmp_path / "ckpt" / RESOLVED_NAME) and os.listdir(tmp_path / "ckpt") == [RESOLVED_NAME]
    # --train-flops was turned into --train-iters: the relaunch trains exactly those iterations
    assert parse_args(["--yaml-cfg", path]) == cfg.replace(training={"train_flops": None})


def test_relaunch_starts_the_recorded_world_size_with_the_file_and_overrides(tmp_path, capsys, monkeypatch):
    from megatron_dllm.cli import relaunch

    cfg = parse_args(["--preset", "cpu-tiny", "--data-path", "d/x", "--tokenizer-type", "SentencePieceTokenizer",
                      "--tokenizer-model", "t.model", "--train-iters", "5"])
    (tmp_path / "launched_here").mkdir()
    monkeypatch.chdir(tmp_path / "launched_here")
    (path,) = write_resolved(cfg, [str(tmp_path)], world_size=4)
    monkeypatch.chdir(tmp_path)  # relaunched from elsewhere: the relative --data-path still means the same
    assert relaunch.main([path, "--dry-run", "--", "--train-iters", "9"]) == 0
    cmd = capsys.readouterr().out.split()
    assert cmd[:3] == ["cd", str(tmp_path / "launched_here"), "&&"]
    assert cmd[-5:] == [relaunch.PRETRAIN, "--yaml-cfg", path, "--train-iters", "9"]
    assert "--nproc-per-node=4" in cmd and "--standalone" in cmd
    assert relaunch.main([path, "--dry-run", "--", "--train-samples", "64"]) == 0  # displaces the file's iterations
    assert capsys.readouterr().out.split()[-2:] == ["--train-samples", "64"]
    assert relaunch.main([path, "--dry-run", "--nproc-per-node", "2"]) == 0
    assert "--nproc-per-node=2" in capsys.readouterr().out
    # torchrun killed by SIGKILL: subprocess gives -9; a requeue script tests the shell's 128 + 9
    monkeypatch.setattr(relaunch.subprocess, "call", lambda cmd, cwd: -9)
    assert relaunch.main([path]) == 137
    with pytest.raises(SystemExit) as exit_:  # a bad override fails before torchrun starts
        relaunch.main([path, "--dry-run", "--", "--train-iters", "0"])
    assert exit_.value.code == 2
    (tmp_path / "launched_here").rmdir()
    assert relaunch.main([path, "--dry-run"]) == 2
    assert f"the run was launched from {tmp_path / 'launched_here'}, which no longer exists" in capsys.readouterr().err
    (tmp_path / "flags.yaml").write_text("preset: cpu-tiny\n")
    assert relaunch.main([str(tmp_path / "flags.yaml"), "--dry-run"]) == 2
    assert "records no world size" in capsys.readouterr().err


def test_relaunch_resumes_a_run_started_without_load(tmp_path, capsys, monkeypatch):
    """A run's resolved file records its --save; relaunching it continues from there (Megatron's
    resume idiom, --load = --save) rather than being refused for the checkpoints it finds."""
    from megatron_dllm.cli import relaunch

    monkeypatch.chdir(tmp_path)
    cfg = parse_args(["--preset", "cpu-tiny", "--save", "my run/ckpt"])
    (path,) = write_resolved(cfg, [str(tmp_path / "my run" / "ckpt")], world_size=2)
    assert relaunch.main([path, "--dry-run"]) == 0
    cmd = shlex.split(capsys.readouterr().out)  # quoted: the paths hold a space
    assert cmd[:3] == ["cd", str(tmp_path), "&&"] and cmd[-4:] == ["--yaml-cfg", path, "--load", "my run/ckpt"]
    assert relaunch.main([path, "--dry-run", "--", "--load", "elsewhere"]) == 0  # a --load given is kept
    assert shlex.split(capsys.readouterr().out)[-2:] == ["--load", "elsewhere"]


def test_relaunch_does_not_repeat_a_rollback(tmp_path, capsys, monkeypatch):
    """A run resumed once with --ckpt-step 2 (or --no-load-optim) records it; relaunched after it
    saved iteration 4, it continues from 4 instead of loading 2 again and saving over 4."""
    from megatron_dllm.cli import relaunch

    monkeypatch.chdir(tmp_path)
    cfg = parse_args(["--preset", "cpu-tiny", "--save", "ckpt", "--load", "ckpt", "--ckpt-step", "2",
                      "--no-load-optim"])
    (path,) = write_resolved(cfg, [str(tmp_path / "ckpt")], world_size=2)
    for iteration in (2, 4):
        (tmp_path / "ckpt" / f"iter_{iteration:07d}").mkdir()
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("4")
    assert relaunch.main([path, "--dry-run"]) == 0
    cmd = shlex.split(capsys.readouterr().out)
    assert "--ckpt-step=2" not in cmd and "--no-load-optim" not in cmd and cmd[-2:] == ["--load", "ckpt"]
    # going back by naming the checkpoint directory, relaunched from elsewhere (its paths are the launch's)
    cfg = parse_args(["--preset", "cpu-tiny", "--save", "ckpt", "--load", "ckpt/iter_0000002"])
    (path,) = write_resolved(cfg, [str(tmp_path / "ckpt")], world_size=2)
    monkeypatch.chdir(tmp_path / "ckpt")
    assert relaunch.main([path, "--dry-run"]) == 0
    cmd = shlex.split(capsys.readouterr().out)
    assert "--load=ckpt/iter_0000002" not in cmd and cmd[-2:] == ["--load", "ckpt"]
    monkeypatch.chdir(tmp_path)
    # a file of one's own asks for that checkpoint (nothing says the run has saved since): kept
    (tmp_path / "back.yaml").write_text("save: ckpt\nload: ckpt/iter_0000002\n")
    assert relaunch.main([str(tmp_path / "back.yaml"), "--nproc-per-node", "1", "--dry-run"]) == 0
    assert shlex.split(capsys.readouterr().out)[-2:] == ["--yaml-cfg", str(tmp_path / "back.yaml")]
    cfg = parse_args(["--preset", "cpu-tiny", "--load", "ckpt", "--ckpt-step", "2"])  # evaluates only: no --save
    (path,) = write_resolved(cfg, [str(tmp_path / "eval")], world_size=1)
    assert relaunch.main([path, "--dry-run"]) == 0
    assert shlex.split(capsys.readouterr().out)[-2:] == ["--yaml-cfg", path]


def test_recompute_flags_mean_what_they_mean_in_megatron_lm():
    assert parse_args([]).model.recompute() == {"recompute_granularity": None}
    assert parse_args(["--recompute-activations"]).model.recompute() == {"recompute_granularity": "selective",
                                                                         "recompute_modules": ["core_attn"]}
    chosen = parse_args(["--recompute-granularity", "selective", "--recompute-modules", "layernorm", "mlp"])
    assert chosen.model.recompute() == {"recompute_granularity": "selective", "recompute_modules": ["layernorm", "mlp"]}
    assert parse_args(["--recompute-granularity", "full", "--recompute-method", "uniform"]).model.recompute() == {
        "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


@pytest.mark.parametrize("flags, described", [
    ([], "recompute off"),
    (["--recompute-activations"], "recompute selective (core_attn)"),
    (["--recompute-activations", "--recompute-modules", "layernorm", "mlp_act"],
     "recompute selective (layernorm, mlp_act)"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform"], "recompute full (uniform, 1 layer a group)"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"],
     "recompute full (uniform, 2 layers a group)"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "3"],
     "recompute full (block, the first 3 of each stage)"),
])
def test_the_start_of_run_line_names_the_recompute_setting(flags, described):
    assert parse_args(flags).model.describe_recompute() == described


@pytest.mark.parametrize("gpt", [None, GPTShape(ffn_hidden_size=128, swiglu=True)])
def test_mlp_act_reaches_the_mlps_not_megatron_core_s_config(gpt):
    """megatron-core's config refuses the name: the MLPs read it from an attribute of their own."""
    chosen = parse_args(["--recompute-activations", "--recompute-modules", "layernorm", "mlp_act"]).model.recompute()
    config, mlp_config = transformer_config(Architecture(Preset(32, 2, 2), 100, 16, "bidirectional", gpt=gpt),
                                            recompute=chosen)
    assert config.recompute_modules == mlp_config.recompute_modules == ["layernorm"]
    assert mlp_config.recompute_mlp_activation
    config, mlp_config = transformer_config(Architecture(Preset(32, 2, 2), 100, 16, "bidirectional", gpt=gpt),
                                            recompute=parse_args(["--recompute-activations"]).model.recompute())
    assert config.recompute_modules == ["core_attn"] and not mlp_config.recompute_mlp_activation


@pytest.mark.parametrize("flags, message", [
    (["--recompute-granularity", "full"], "--recompute-granularity full needs --recompute-method uniform|block"),
    (["--recompute-activations", "--recompute-num-layers", "2"], "apply to --recompute-granularity full"),
    (["--profile", "--profile-step-start", "5", "--profile-step-end", "5", "--data-path", "x"],
     "--profile needs --profile-step-end > --profile-step-start"),
])
def test_impossible_combinations_are_rejected_at_parse_time(capsys, flags, message):
    with pytest.raises(SystemExit):
        parse_args(flags)
    assert message in capsys.readouterr().err


def test_retention_keeps_the_newest_the_every_kth_and_the_tracked():
    saves = [100, 200, 300, 400, 500, 600]
    assert retention.kept(saves, 600, keep_last=2, keep_interval=None) == {500, 600}
    assert retention.kept(saves, 600, keep_last=1, keep_interval=200) == {200, 400, 600}
    # a run rolled back to 300 (tracker edited): the abandoned 400-600 stay, older ones go
    assert retention.kept(saves, 300, keep_last=1, keep_interval=None) == {300, 400, 500, 600}


def _checkpoint(root, iteration, manifest=True):
    path = root / f"iter_{iteration:07d}"
    path.mkdir(parents=True)
    (path / "common.pt").write_bytes(b"x" * 10)
    if manifest:
        (path / "manifest.json").write_text(json.dumps({"format": "megatron_dllm checkpoint manifest",
                                                        "files": {"common.pt": {"size": 10}}}))


def test_retention_removes_exactly_the_unkept_complete_checkpoints(tmp_path):
    root = tmp_path / "ckpt"
    for it in (2, 4, 6, 8, 10):
        _checkpoint(root, it)
    _checkpoint(root, 1, manifest=False)  # written by another tool: never removed
    (root / "iter_0000012.incomplete").mkdir()  # a save under way: not retention's business
    (root / "latest_checkpointed_iteration.txt").write_text("10")
    removed = retention.apply(str(root), keep_last=2, keep_interval=4)
    assert sorted(os.path.basename(p) for p in removed) == ["iter_0000002", "iter_0000006"]
    assert sorted(os.listdir(root)) == ["iter_0000001", "iter_0000004", "iter_0000008", "iter_0000010",
                                        "iter_0000012.incomplete", "latest_checkpointed_iteration.txt"]
    (root / "iter_0000004.removing").mkdir()  # a removal killed half-way
    assert retention.remove_leftovers(str(root)) == [str(root / "iter_0000004.removing")]


def test_checkpoints_on_disk_counts_what_retention_leaves():
    assert retention.checkpoints_on_disk(1000, 0, 100, None, None) == (10, 10)
    assert retention.checkpoints_on_disk(1050, 0, 100, None, None) == (11, 11)  # and the final save
    assert retention.checkpoints_on_disk(1000, 0, 100, 2, None) == (3, 3)  # 2 kept + the one being written
    assert retention.checkpoints_on_disk(1000, 0, 100, 2, 500) == (5, 5)
    assert retention.checkpoints_on_disk(1000, 950, 100, None, None, [950]) == (2, 1)  # resumed: its final save
    assert retention.checkpoints_on_disk(1000, 1000, 100, None, None, [1000]) == (1, 0)  # finished: evaluates
    # resumed at 40 (saves every 5; keep 1 and every 10th): 10, 20, 30, 40 there; 50, 60 kept after, the
    # newest and the one being written: at most 7, bounded by 8 (the newest may be a 10th); 4 more
    assert retention.checkpoints_on_disk(60, 40, 5, 1, 10, [10, 20, 30, 40]) == (8, 4)
    # a job stopped off the save interval (30), keep 2: 30, 50 and the one being written; 1 more
    assert retention.checkpoints_on_disk(100, 30, 50, 2, None, [30]) == (3, 2)
    # more checkpoints there than retention keeps (it was set later): a save still comes before removals
    assert retention.checkpoints_on_disk(100, 50, 10, 1, None, [10, 20, 30, 40, 50]) == (6, 1)
    # a long run with retention: the kept checkpoints are not counted again against free space
    there = [*range(10**5, 10**6, 10**5), 899_000]  # every 100,000th, and the last two
    assert retention.checkpoints_on_disk(10**6, 9 * 10**5, 1000, 2, 10**5, there) == (13, 3)
    assert retention.bytes_per_checkpoint(10, bf16=True, ema=True) == 10 * (2 + 4 + 8 + 4)


def test_consecutive_non_finite_iterations_stop_only_in_a_row():
    counter = NonFiniteCounter(max_consecutive=2)
    assert [counter.record(ok) for ok in (False, True, False, False)] == [False, False, False, True]
    assert counter.skipped == 3


def test_a_loss_spike_is_reported_against_the_recent_mean():
    spikes = LossSpikes(factor=2.0, window=5, warmup=3)
    assert [spikes.check(x) for x in (4.0, 4.0, 4.0)] == [None, None, None]
    assert spikes.check(float("nan")) is None and spikes.check(7.9) is None
    assert spikes.check(20.0) == pytest.approx((4 + 4 + 4 + 7.9) / 4)
    assert LossSpikes(factor=0).check(1e9) is None


def test_mfu_peak_comes_from_the_flag_or_the_device_table(monkeypatch):
    assert observability.peak_flops(1.5e15, fp8=False) == (1.5e15, "--peak-flops 1.5e+15")
    monkeypatch.setattr(observability.platform, "device_name", lambda: None)
    peak, why = observability.peak_flops(None, fp8=False)
    assert peak is None and "not meaningful" in why
    monkeypatch.setattr(observability.platform, "device_name", lambda: "NVIDIA H100 80GB HBM3")
    assert observability.peak_flops(None, fp8=False)[0] == 989e12
    assert observability.peak_flops(None, fp8=True)[0] == 1979e12
    monkeypatch.setattr(observability.platform, "device_name", lambda: "NVIDIA H100 PCIe")
    assert observability.peak_flops(None, fp8=False)[0] == 756e12
    monkeypatch.setattr(observability.platform, "device_name", lambda: "Some Future GPU")
    assert observability.peak_flops(None, fp8=False)[0] is None
    assert observability.format_eta(2 * 86400 + 3 * 3600 + 4 * 60 + 5) == "2d 03:04:05"


def test_exit_interval_stops_at_its_multiples():
    exits = ExitConditions(TrainingConfig(exit_interval=3))
    assert [exits.reason(i) for i in (1, 2, 3, 4, 6)] == [None, None, "--exit-interval 3", None, "--exit-interval 3"]


def test_the_1_7b_example_config_parses_with_retention_sized_for_the_2_1t_token_run():
    example = os.path.join(REPO, "examples", "pretrain_1.7b.yaml")
    cfg = parse_args(["--yaml-cfg", example, "--family", "mdlm", "--data-path", "/data/x_text_document",
                      "--tokenizer-model", "tokenizer.json", "--save", "ckpt", "--load", "ckpt"])
    t, ckpt = cfg.training, cfg.checkpoint
    assert cfg.model.recompute() == {"recompute_granularity": None}  # fused attention: core_attn saves nothing
    assert t.train_iters * t.global_batch_size * cfg.model.seq_length == pytest.approx(2.1e12, rel=1e-3)
    assert t.exit_signal_handler and t.check_for_nan_in_loss_and_grad and ckpt.async_save
    on_disk, _ = retention.checkpoints_on_disk(t.train_iters, 0, ckpt.save_interval, ckpt.keep_last_n_checkpoints,
                                               ckpt.keep_checkpoint_interval)
    each = retention.bytes_per_checkpoint(1_780_000_000, bf16=True, ema=False)
    assert on_disk == 24 and on_disk * each < 0.7e12  # instead of 1002 checkpoints, 25 TB


def test_exit_duration_and_interval_0_mean_off_as_in_megatron_lm():
    cfg = parse_args(["--exit-duration-in-mins", "0", "--exit-interval", "0"])
    exits = ExitConditions(cfg.training)  # no collective: neither condition is on
    assert [exits.reason(i) for i in (1, 2, 100)] == [None, None, None]


@pytest.mark.parametrize("flag, value", [("--exit-duration-in-mins", "-1"), ("--exit-duration-in-mins", "-0.5"),
                                         ("--exit-interval", "-3")])
def test_negative_exit_duration_or_interval_is_one_error_naming_the_flag(capsys, flag, value):
    with pytest.raises(SystemExit) as exit_:
        parse_args([flag, value])
    (line,) = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2 and line.startswith(f"error: argument {flag}: expected ") and ">= 0" in line
