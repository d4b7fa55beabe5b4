"""Checkpoints across layer specs: `--transformer-impl local` and `transformer_engine` load each
other's. TransformerEngine's linears hold the same weights as the local spec's plus an
`_extra_state` (their FP8 scaling state), which megatron-core checkpoints as a ShardedObject
through `make_sharded_tensors_for_checkpoint`, the path both specs' linears take. megatron-core's
local linears save None there and ignore what they load, so the two specs' checkpoints have the
same keys; TE keeps its own state when it loads None (`TransformerEngineBaseModule.set_extra_state`).
On CPU, where TE cannot be installed, the local linears are given an extra state that follows
TE's protocol; on a GPU with TE the real layers are compared."""
import pytest
import step_cases
import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from megatron_dllm import platform
from megatron_dllm.checkpoint import optimizer_settings, training_state
from megatron_dllm.checkpoint.identity import ModelIdentity
from megatron_dllm.checkpoint.load_plan import RESUME, LoadPlan
from megatron_dllm.checkpoint.meta import CheckpointMeta

pytestmark = pytest.mark.usefixtures("world_of_one")
LINEARS = (ColumnParallelLinear, RowParallelLinear)
# megatron-core's own: None saved, anything loaded ignored (its local linears' TE compatibility)
LOCAL_EXTRA_STATE = {cls: (cls.get_extra_state, cls.set_extra_state) for cls in LINEARS}


def get_extra_state(self):
    return self.fp8_state if hasattr(self, "fp8_state") else torch.empty(0)  # TE: empty without FP8 state


def set_extra_state(self, state):
    if state is None:  # as TE: a checkpoint without this module's state keeps the module's own
        return
    self.fp8_state = state.clone()


@pytest.fixture
def te_like_linears(monkeypatch):
    """`give()`: from then on, the local spec's linears carry an extra state as TE's do."""

    def give():
        for cls in LINEARS:
            monkeypatch.setattr(cls, "get_extra_state", get_extra_state)
            monkeypatch.setattr(cls, "set_extra_state", set_extra_state)

    return give


def _trained(seed: int, *flags: str):
    """A small MDLM run after one iteration (the optimizer has state to save)."""
    return step_cases.train("mdlm", 1, "--seed", str(seed), *flags)[3]


def _save(built, root) -> str:
    identity = ModelIdentity("mdlm", 32, 2, 2, step_cases.VOCAB, step_cases.VOCAB - 1)
    return training_state.save_checkpoint(str(root), CheckpointMeta(1, identity, 4, seq_length=16), built.model,
                                          built.optimizer, built.scheduler)


def _load(built, path) -> None:
    """As a resumed run loads: weights, optimizer state, schedule and RNG states."""
    plan = LoadPlan(RESUME, training_state.parallel_layout(), path, CheckpointMeta.read(path), optimizer=True,
                    scheduler=True, rng=True, iteration=1, consumed_samples=4,
                    optimizer_settings=optimizer_settings.of_run(built.scheduler, built.optimizer))
    training_state.load_checkpoint(plan, built.model, built.optimizer, built.scheduler, log=lambda line: None)


def _weights(built) -> dict:
    return {k: v.detach().float().clone() for k, v in built.model[0].module.state_dict().items()
            if torch.is_tensor(v) and not k.endswith("_extra_state")}


def _adam_moments(built) -> list:
    return [state[k].clone() for opt in built.optimizer.chained_optimizers for state in opt.optimizer.state.values()
            for k in ("exp_avg", "exp_avg_sq")]


def _linears(built) -> list:
    return [m for m in built.model[0].modules() if isinstance(m, LINEARS)]


def _assert_loaded(loaded, saved) -> None:
    expected, got = _weights(saved), _weights(loaded)
    assert expected.keys() == got.keys() and all(torch.equal(got[k], v) for k, v in expected.items())
    assert all(torch.equal(a, b) for a, b in zip(_adam_moments(loaded), _adam_moments(saved), strict=True))


def test_a_local_checkpoint_loads_into_linears_with_fp8_state(te_like_linears, tmp_path):
    saved = _trained(0)
    path = _save(saved, tmp_path / "ckpt")
    te_like_linears()
    loaded = step_cases.build("mdlm", "--seed", "1")[2]
    before = _weights(loaded)
    _load(loaded, path)
    _assert_loaded(loaded, saved)
    assert any(not torch.equal(before[k], v) for k, v in _weights(loaded).items())  # the load changed them
    assert _linears(loaded) and not any(hasattr(m, "fp8_state") for m in _linears(loaded))  # their own kept


def test_a_checkpoint_with_fp8_state_loads_into_either_spec(te_like_linears, tmp_path):
    te_like_linears()
    saved = _trained(0)
    for i, m in enumerate(_linears(saved)):
        m.set_extra_state(torch.full((3,), float(i)))
    path = _save(saved, tmp_path / "ckpt")
    loaded = step_cases.build("mdlm", "--seed", "1")[2]
    _load(loaded, path)
    _assert_loaded(loaded, saved)
    assert [m.fp8_state.tolist() for m in _linears(loaded)] == [[float(i)] * 3 for i in range(len(_linears(saved)))]
    with pytest.MonkeyPatch.context() as undo:  # the local spec's own linears again
        for cls in LINEARS:
            undo.setattr(cls, "get_extra_state", LOCAL_EXTRA_STATE[cls][0])
            undo.setattr(cls, "set_extra_state", LOCAL_EXTRA_STATE[cls][1])
        plain = step_cases.build("mdlm", "--seed", "2")[2]
        _load(plain, path)
        _assert_loaded(plain, saved)


@pytest.mark.gpu
@pytest.mark.skipif(not platform.HAS_TE, reason="needs TransformerEngine")
def test_local_and_transformer_engine_specs_load_each_others_checkpoints_and_agree(tmp_path):
    """bf16: a local-spec run's checkpoint loads into the TE spec, whose next loss on the same
    micro-batches is the local spec's within bf16 tolerance; the TE run's checkpoint loads back."""
    local_flags, te_flags = ("--bf16", "--transformer-impl", "local"), ("--bf16", "--transformer-impl",
                                                                         "transformer_engine")
    local = _trained(0, *local_flags)
    path = _save(local, tmp_path / "local")
    te = step_cases.build("mdlm", "--seed", "1", *te_flags)[2]
    _load(te, path)
    _assert_loaded(te, local)
    assert any(type(m).__module__.startswith("megatron.core.extensions.transformer_engine")
               for m in te.model[0].modules())

    def next_loss(built, *flags):
        config, family, _ = step_cases.build("mdlm", *flags)
        batches = step_cases.Batches(family, config.model.seq_length)
        return step_cases.step.train_step(built.model, built.optimizer, built.scheduler, family, batches, 4, config,
                                          built.transformer_config.timers, iteration=2)[0]

    loss_local, loss_te = next_loss(local, *local_flags), next_loss(te, *te_flags)
    assert abs(loss_te - loss_local) <= 2e-2 * abs(loss_local), (loss_local, loss_te)
    path = _save(te, tmp_path / "te")
    back = step_cases.build("mdlm", "--seed", "2", *local_flags)[2]
    _load(back, path)
    _assert_loaded(back, te)
