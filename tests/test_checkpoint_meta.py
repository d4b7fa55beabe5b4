"""Checkpoint metadata (`CheckpointMeta`) and the load plan: the stored form round-trips, a bad
entry is named with its checkpoint, `plan_load` decides resume / finetune / converted / reshard /
nothing from the flags and the metadata alone; and a checkpoint written by an earlier version
(kept in tests/fixtures) still verifies, inspects and resumes."""
import os
import re
import tarfile

import pytest

from megatron_dllm.checkpoint import CheckpointError
from megatron_dllm.checkpoint.identity import ModelIdentity
from megatron_dllm.checkpoint.layout import Found
from megatron_dllm.checkpoint.load_plan import CONVERTED, FINETUNE, NOTHING, RESUME, plan_load
from megatron_dllm.checkpoint.meta import CheckpointMeta
from megatron_dllm.checkpoint.tokenizer_record import TokenizerRecord
from megatron_dllm.config.checkpoint import CheckpointConfig

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
# Written before CheckpointMeta existed (commit c395ccb) by pretrain_dllm.py with these flags on the
# demo corpus (--demo-cache-dir /tmp/ckptmeta_fx/demo), --train-iters 3 --save: see fixtures/README.md.
OLD_CHECKPOINT = os.path.join(FIXTURES, "checkpoint_mdlm_tiny_iter3.tar.xz")
OLD_RUN = ["--preset", "cpu-tiny", "--hidden-size", "4", "--num-layers", "1", "--num-attention-heads", "1",
           "--make-vocab-size-divisible-by", "1", "--seq-length", "16", "--micro-batch-size", "2",
           "--global-batch-size", "4", "--lr-warmup-iters", "0", "--log-interval", "1", "--eval-interval", "100"]
OLD_IDENTITY = ModelIdentity("mdlm", 4, 1, 1, 4097, 4096)
# What that version read back from it: row 5 of the word embeddings, and the losses of iterations
# 4 and 5 when it resumed with --train-iters 5 on a demo corpus at another path (a changed data mix)
OLD_EMBEDDING_ROW5 = [0.22850054502487183, 0.16676755249500275, -0.0546434186398983, 0.009803500957787037]
OLD_RESUMED_LOSSES = [3.763106346130371, 4.673627018928528]

IDENTITY = ModelIdentity("mdlm", 64, 2, 4, 4097, 4096)
TRAINED = CheckpointMeta(6, IDENTITY, 48, seq_length=32, tokenizer=TokenizerRecord("SentencePieceTokenizer", "/t.model",
                                                                                  {}, "ab" * 32),
                         data_mix=("/data/a",), data_mix_start=0, scheduler={"num_steps": 6}, rng_layout=(1, 1, 2))


def _plan(meta, *, layout=(1, 1, 2), data_path=("/data/a",), ema=None, optimizer_settings=None,
          distributed_optimizer=False, **flags):
    ckpt = CheckpointConfig(**{"load": "/ckpt", **flags})
    found = Found("/ckpt/iter_0000006", 6, "the tracker") if meta is not None else None
    return plan_load(ckpt, found, meta, identity=IDENTITY, layout=layout, optimizer=True, ema_decay=ema,
                     data_path=list(data_path), tokenizer_model=None, optimizer_settings=optimizer_settings,
                     distributed_optimizer=distributed_optimizer)


SETTINGS = {"max_lr": 1e-3, "min_lr": 1e-4, "lr_warmup_steps": 0, "lr_decay_steps": 6, "lr_decay_style": "cosine",
            "start_wd": 0.1, "wsd_decay_steps": 2, "lr_wsd_decay_style": "cosine", "adam_betas": [0.9, 0.95],
            "adam_eps": 1e-8}
SCHEDULED = TRAINED.replace(scheduler={"num_steps": 6, "end_wd": 0.1, "wd_incr_style": "constant", "wd_incr_steps": 6,
                                       **{k: v for k, v in SETTINGS.items() if not k.startswith("adam_")}},
                            adam={"adam_betas": [0.9, 0.95], "adam_eps": 1e-8})


def test_the_same_mix_written_otherwise_is_not_a_change(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    os.symlink(tmp_path / "data", tmp_path / "link")
    meta = TRAINED.replace(data_mix=("0.5", str(tmp_path / "data/a"), "0.5", "data/b"))
    assert not meta.data_mix_changed([".50", "data/a", "5e-1", str(tmp_path / "link/b")])
    assert not meta.data_mix_changed(["3", "data/a", "3", "data/b"])  # megatron-core normalises the weights
    assert not TRAINED.replace(data_mix=("0.3", "data/a", "0.7", "data/b")).data_mix_changed(
        ["3", "data/a", "7", "data/b"])
    assert meta.data_mix_changed(["0.5", "data/b", "0.5", "data/a"])  # another order: another blended index
    assert meta.data_mix_changed(["data/a", "data/b"])  # unweighted: by the datasets' sizes
    assert meta.data_mix_changed(["0.4", "data/a", "0.6", "data/b"])
    assert meta.data_mix_changed(["0.5", "data/a", "0.5", "data/c"])
    (tmp_path / "run").mkdir()  # a run directory of links to the files themselves
    for ext in (".bin", ".idx"):
        os.symlink(tmp_path / f"data/b{ext}", tmp_path / f"run/mine{ext}")
    assert not meta.data_mix_changed(["0.5", "data/a", "0.5", "run/mine"])


def test_plan_refuses_optimizer_state_megatron_cannot_read():
    distributed = TRAINED.replace(distributed_optimizer=True)  # saved at (PP, TP, DP) = (1, 1, 2)
    with pytest.raises(CheckpointError, match=r"saved with --use-distributed-optimizer and this run is without it: "
                                              r"give the checkpoint's setting, or --no-load-optim"):
        _plan(distributed)
    with pytest.raises(CheckpointError, match=r"saved without --use-distributed-optimizer and this run is with it"):
        _plan(TRAINED.replace(distributed_optimizer=False), distributed_optimizer=True)
    with pytest.raises(CheckpointError, match=r"reshards across data parallelism only \(saved at TP=1, PP=1; this run "
                                              r"TP=2, PP=1\): load it at TP=1, PP=1, or --no-load-optim"):
        _plan(distributed, layout=(1, 2, 1), distributed_optimizer=True)
    assert _plan(distributed, layout=(1, 1, 4), distributed_optimizer=True).optimizer  # across DP: fine
    assert not _plan(distributed, layout=(1, 2, 1), no_load_optim=True).optimizer  # a fresh optimizer: fine


def test_plan_refuses_other_optimizer_settings_unless_told_whose_to_keep():
    assert _plan(SCHEDULED, optimizer_settings=SETTINGS).optimizer_settings == SETTINGS
    changed = {**SETTINGS, "max_lr": 1e-4, "lr_decay_steps": 12, "adam_betas": [0.9, 0.99]}
    expected = ("--lr 0.0001 (checkpoint 0.001); decay (--lr-decay-iters, default --train-iters) 12 (checkpoint 6); "
                "--adam-beta1/--adam-beta2 [0.9, 0.99] (checkpoint [0.9, 0.95]); give --override-opt-param-scheduler")
    with pytest.raises(CheckpointError, match=re.escape(expected)):
        _plan(SCHEDULED, optimizer_settings=changed)
    plan = _plan(SCHEDULED, optimizer_settings=changed, override_opt_param_scheduler=True)
    assert plan.optimizer_settings == changed and plan.notes[0].startswith("training with this run's optimizer")
    plan = _plan(SCHEDULED, optimizer_settings=changed, use_checkpoint_opt_param_scheduler=True)
    assert plan.optimizer_settings == SETTINGS and plan.notes[0].startswith("keeping the checkpoint's optimizer")
    # the WSD decay matters to the WSD style only; a checkpoint without Adam's settings keeps its param groups'
    assert _plan(SCHEDULED, optimizer_settings={**SETTINGS, "wsd_decay_steps": 3}).notes == ()
    older = SCHEDULED.replace(adam=None)
    plan = _plan(older, optimizer_settings={**SETTINGS, "adam_eps": 1e-6})
    assert plan.notes == () and "adam_eps" not in plan.optimizer_settings
    # --lr-warmup-fraction's warmup, which earlier versions rounded down: it resumes as saved
    rounded = SCHEDULED.replace(scheduler={**SCHEDULED.scheduler, "lr_warmup_steps": 2})
    plan = _plan(rounded, optimizer_settings={**SETTINGS, "lr_warmup_steps": 2.4})
    assert plan.notes == () and plan.optimizer_settings["lr_warmup_steps"] == 2
    with pytest.raises(CheckpointError, match=re.escape("warmup (--lr-warmup-iters/--lr-warmup-fraction) 3.4")):
        _plan(rounded, optimizer_settings={**SETTINGS, "lr_warmup_steps": 3.4})


def test_metadata_round_trips_through_the_stored_form():
    stored = TRAINED.to_dict()
    assert stored["data_mix"] == ["/data/a"] and stored["rng_layout"] == [1, 1, 2]  # lists, as always stored
    assert "ema_decay" not in stored and "run_id" not in stored
    assert CheckpointMeta.from_dict(stored, "/ckpt") == TRAINED
    model_only = CheckpointMeta(0, IDENTITY, seq_length=32)
    assert set(model_only.to_dict()) == {"iteration", "consumed_samples", "identity", "seq_length"}
    assert CheckpointMeta.from_dict(model_only.to_dict(), "/ckpt").model_only


@pytest.mark.parametrize("change, message", [
    ({"iteration": None}, "/ckpt: no 'iteration' in its common state"),
    ({"consumed_samples": "12"}, "/ckpt: 'consumed_samples' in its common state is '12', expected int"),
    ({"rng_layout": [1, 2]}, "/ckpt: 'rng_layout' in its common state is [1, 2], expected [PP, TP, DP] sizes"),
    ({"identity": {"family": "mdlm"}}, "/ckpt: no model identity"),
    ({"tokenizer": {"kind": "x"}}, "/ckpt: malformed tokenizer record"),
])
def test_a_bad_entry_is_named_with_its_checkpoint(change, message):
    stored = {**TRAINED.to_dict(), **change}
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
        CheckpointMeta.from_dict(stored, "/ckpt")


def test_plan_resume_restores_everything_and_continues():
    plan = _plan(TRAINED)
    assert (plan.kind, plan.iteration, plan.consumed_samples, plan.data_offset) == (RESUME, 6, 48, 0)
    assert plan.optimizer and plan.scheduler and plan.rng and not plan.ema and not plan.notes
    assert plan.describe() == "weights, optimizer, RNG"
    with_ema = TRAINED.replace(ema_decay=0.999)
    assert _plan(with_ema, ema=0.999).describe() == "weights, optimizer, RNG, EMA"
    assert _plan(with_ema, ema=0.99).notes == ("EMA decay 0.999 -> 0.99 (--ema-decay) from iteration 6",)
    with pytest.raises(CheckpointError, match=r"holds EMA weights \(decay 0.999\), which this run without --ema-decay "
                                              r"would leave out of every later checkpoint; give --ema-decay 0.999"):
        _plan(with_ema)
    assert _plan(TRAINED, no_load_optim=True, no_load_rng=True).describe() == "weights"


def test_plan_names_a_load_path_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "afile").write_text("")
    for path, what in [(tmp_path / "afile", "is a file, not a checkpoint directory"),
                       (tmp_path / "missing", "does not exist"), (tmp_path, "holds no checkpoint")]:
        with pytest.raises(CheckpointError, match=rf"^--load {path} {what} \(expected "):
            plan_load(CheckpointConfig(load=str(path)), None, None, identity=IDENTITY, layout=(1, 1, 1),
                      optimizer=True, ema_decay=None, data_path=[], tokenizer_model=None)


def test_plan_reshard_leaves_the_rng_states_out():
    plan = _plan(TRAINED, layout=(1, 2, 1))
    assert plan.reshard and not plan.rng and plan.optimizer
    assert plan.notes == ("not restoring RNG states: saved under (PP, TP, DP) = (1, 1, 2), loading under (1, 2, 1)",)


def test_plan_finetune_converted_and_nothing():
    plan = _plan(TRAINED, finetune=True)
    assert (plan.kind, plan.iteration, plan.consumed_samples, plan.describe()) == (
        FINETUNE, 0, 0, "weights only (--finetune)")
    assert not (plan.optimizer or plan.scheduler or plan.rng)
    plan = _plan(CheckpointMeta(3, IDENTITY, seq_length=32))
    assert (plan.kind, plan.iteration, plan.optimizer, plan.rng) == (CONVERTED, 3, False, False)
    assert plan_load(CheckpointConfig(), None, None, identity=IDENTITY, layout=(1, 1, 1), optimizer=True,
                     ema_decay=None, data_path=None, tokenizer_model=None).kind == NOTHING
    plan = plan_load(CheckpointConfig(load="/run", save="/run"), None, None, identity=IDENTITY, layout=(1, 1, 1),
                     optimizer=True, ema_decay=None, data_path=None, tokenizer_model=None)
    assert plan.kind == NOTHING and plan.notes == ("no checkpoint in /run: starting from iteration 0",)
    with pytest.raises(CheckpointError, match="--load /nowhere does not exist"):
        plan_load(CheckpointConfig(load="/nowhere"), None, None, identity=IDENTITY, layout=(1, 1, 1),
                  optimizer=True, ema_decay=None, data_path=None, tokenizer_model=None)


def test_plan_data_mix_switch_and_identity_mismatch():
    plan = _plan(TRAINED, data_path=("0.5", "/data/a", "0.5", "/data/b"))
    assert plan.data_offset == 48
    assert plan.notes == ("data mix changed at iteration 6: ['/data/a'] -> ['0.5', '/data/a', '0.5', '/data/b']; "
                          "reading the new mix from its first sample",)
    other = TRAINED.replace(identity=ModelIdentity("ar", 64, 2, 4, 4097, 4096))
    with pytest.raises(CheckpointError, match=r"does not match this run \(family: checkpoint 'ar' vs this run 'mdlm'"):
        _plan(other)
    # --finetune trains the weights under another objective (AR adapted to MDLM); the shapes still must match
    plan = _plan(other, finetune=True)
    assert plan.kind == FINETUNE
    assert plan.notes == ("--finetune: the weights of a --family ar model, trained as --family mdlm",)
    with pytest.raises(CheckpointError, match=r"\(hidden_size: checkpoint 96 vs this run 64\)$"):
        _plan(TRAINED.replace(identity=ModelIdentity("ar", 96, 2, 4, 4097, 4096)), finetune=True)


@pytest.fixture
def old_checkpoint(tmp_path):
    root = tmp_path / "old"
    with tarfile.open(OLD_CHECKPOINT) as tar:
        tar.extractall(root, filter="data")
    return root


def test_fixture_is_small():
    assert os.path.getsize(OLD_CHECKPOINT) < 600_000


def test_a_checkpoint_of_an_earlier_version_verifies_and_inspects(old_checkpoint, world_of_one, capsys):
    from megatron_dllm.cli import verify_checkpoint
    from megatron_dllm.hf import export

    path = str(old_checkpoint / "iter_0000003")
    assert verify_checkpoint.main([str(old_checkpoint)]) == 0
    assert capsys.readouterr().out.strip().endswith(
        "; iteration 3, 12 consumed samples, mdlm 1x4 (vocab 4097)")
    meta = CheckpointMeta.read(path)
    assert (meta.iteration, meta.consumed_samples, meta.identity, meta.seq_length) == (3, 12, OLD_IDENTITY, 16)
    assert meta.rng_layout == (1, 1, 1) and meta.scheduler["num_steps"] == 3 and meta.data_mix_start == 0
    assert meta.tokenizer.type == "SentencePieceTokenizer" and len(meta.tokenizer.sha256) == 64
    assert meta.run_id is not None and not meta.model_only and meta.ema_decay is None
    assert meta.distributed_optimizer is False  # told by megatron's own optimizer state, not by to_dict
    assert CheckpointMeta.from_dict(meta.to_dict(), path) == meta.replace(run_id=None, distributed_optimizer=None)
    model, identity, _, arch = export.load_megatron_model(str(old_checkpoint))
    assert identity == OLD_IDENTITY and arch.seq_length == 16
    assert model.state_dict()["embedding.word_embeddings.weight"][5].tolist() == OLD_EMBEDDING_ROW5


@pytest.mark.slow
def test_a_checkpoint_of_an_earlier_version_resumes(old_checkpoint, pretrain):
    proc, records = pretrain(1, *OLD_RUN, "--train-iters", "5", "--load", str(old_checkpoint),
                             "--save", str(old_checkpoint), "--use-checkpoint-opt-param-scheduler")
    loaded = f"loaded checkpoint {old_checkpoint / 'iter_0000003'} at iteration 3: weights, optimizer, RNG"
    assert loaded in proc.stdout
    assert "data mix changed at iteration 3" in proc.stdout  # the demo corpus lies elsewhere now
    trained = [r for r in records if "loss" in r]
    assert [(r["iteration"], r["consumed_samples"]) for r in trained] == [(4, 16), (5, 20)]
    # the same steps as the version that wrote it took (exactly, on the CPU it was recorded on)
    assert [r["loss"] for r in trained] == pytest.approx(OLD_RESUMED_LOSSES, rel=1e-5)
    assert CheckpointMeta.read(str(old_checkpoint / "iter_0000005")).consumed_samples == 20


def test_a_checkpoint_saved_with_another_adam_kernel_resumes_with_the_fused_one(old_checkpoint, demo_cache, tmp_path):
    """torch restores the saved param groups' kernel choice (here torch's default, from before
    training used the fused kernel); the run puts its own back, with the step counts it reads."""
    from megatron_dllm import platform
    from megatron_dllm.config import parse_args
    from megatron_dllm.training.trainer import Trainer

    try:
        trainer = Trainer(parse_args([*OLD_RUN, "--demo-cache-dir", demo_cache, "--train-iters", "5",
                                      "--load", str(old_checkpoint), "--use-checkpoint-opt-param-scheduler",
                                      "--save", str(tmp_path / "save"), "--tensorboard-dir", str(tmp_path / "tb")]))
        adam = trainer.optimizer.optimizer
        assert trainer.iteration == 3 and all(g["fused"] and not g["foreach"] for g in adam.param_groups)
        assert {(s["step"].item(), s["step"].device == p.device) for p, s in adam.state.items()} == {(3.0, True)}
    finally:
        platform.destroy_distributed()



def _as_if_trained_with(monkeypatch, record: TokenizerRecord) -> None:
    """The fixture checkpoint with `record` for its tokenizer record (its own names a file of the
    machine that wrote it), as export and sampling load it."""
    from megatron_dllm.hf import export

    load = export.load_megatron_model

    def load_with_record(*args, **kwargs):
        model, identity, meta, arch = load(*args, **kwargs)
        return model, identity, meta.replace(tokenizer=record), arch

    monkeypatch.setattr(export, "load_megatron_model", load_with_record)


def _export_and_sample_errors(ckpt, tmp_path, capsys, *flags) -> list[str]:
    from megatron_dllm.cli import convert_to_hf, sample

    assert convert_to_hf.main(["--load", str(ckpt), "--out", str(tmp_path / "hf"), *flags]) == 2
    assert sample.main(["--load", str(ckpt), "--num-samples", "1", "--steps", "2", "--output",
                        str(tmp_path / "samples.json"), *flags]) == 2
    assert not (tmp_path / "hf").exists() and not (tmp_path / "samples.json").exists()
    return capsys.readouterr().err.splitlines()


def test_export_and_sampling_refuse_a_recorded_tokenizer_replaced_or_gone(old_checkpoint, world_of_one, sp_model,
                                                                          tmp_path, monkeypatch, capsys):
    """Without tokenizer flags the recorded file is used only with the recorded content; a file
    gone is named as the checkpoint's, not as a --tokenizer-model the user never gave."""
    import shutil

    from megatron_dllm.config.data import TokenizerConfig
    from megatron_dllm.sampling import load_inference_model

    tok = tmp_path / "tok.model"
    shutil.copyfile(sp_model, tok)
    _as_if_trained_with(monkeypatch, TokenizerRecord.of(TokenizerConfig("SentencePieceTokenizer", str(tok))))
    assert load_inference_model(str(old_checkpoint)).tokenizer.vocab_size == 4097  # the recorded file, unchanged
    other = bytearray(tok.read_bytes())
    other[-1] ^= 0xFF
    tok.write_bytes(bytes(other))  # replaced in place: same path, other content
    changed = f"error: --load {old_checkpoint}: its tokenizer {tok} has changed since training (sha256 "
    assert [line[:len(changed)] for line in _export_and_sample_errors(old_checkpoint, tmp_path, capsys)] == \
        [changed, changed]
    tok.unlink()
    gone = f"error: --load {old_checkpoint}: its tokenizer {tok} is gone; give --tokenizer-type/--tokenizer-model"
    assert _export_and_sample_errors(old_checkpoint, tmp_path, capsys) == [gone, gone]


def test_export_and_sampling_refuse_tokenizer_options_other_than_the_recorded_ones(old_checkpoint, world_of_one,
                                                                                   tmp_path, monkeypatch, capsys):
    from conftest import tekken_vocab

    from megatron_dllm.config.data import TokenizerConfig

    vocab = tekken_vocab(tmp_path, 2000)
    _as_if_trained_with(monkeypatch, TokenizerRecord.of(TokenizerConfig("TikTokenizer", vocab, vocab_size=1500)))
    flags = ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", vocab, "--vocab-size", "1500",
             "--tiktoken-pattern", "v1"]
    refused = (f"error: --tiktoken-pattern v1 but {old_checkpoint} was trained with v2 (give its tokenizer options, "
               f"or only --tokenizer-type/--tokenizer-model to use the recorded ones)")
    assert _export_and_sample_errors(old_checkpoint, tmp_path, capsys, *flags) == [refused, refused]
