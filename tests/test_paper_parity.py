"""Parity with the paper's code: its model-size names are aliases of the presets with the same
architecture, `--apply-wd-to-all-params` decays every parameter (its AdamW over all of them) while
the default keeps Megatron's exemption of biases and 1-D parameters, and `--lr-warmup-fraction 0.01
--lr-warmup-min-iters 100` is its warmup, max(1% of the steps, 100).
"""
import pytest

from megatron_dllm.config.optimizer import OptimizerConfig
from megatron_dllm.config.parallel import ParallelConfig
from megatron_dllm.config.run import parse_args
from megatron_dllm.model.presets import PAPER_CODE_NAMES, PAPER_PRESETS, get_preset

# The paper code's configs/model/<name>.yaml: name -> (hidden_size, n_blocks, n_heads), recorded
# from its repository (cond_dim 128 and tie_word_embeddings False in every one).
PAPER_CODE_YAML = {
    "6M": (256, 6, 4), "19M": (384, 8, 6), "34M": (512, 8, 8), "48M": (576, 9, 9), "66M": (640, 10, 10),
    "85M": (640, 13, 10), "75M": (640, 16, 8), "113M": (768, 12, 12), "142M": (768, 15, 12),
    "170M": (768, 18, 12), "180M": (896, 14, 14), "206M": (896, 16, 14), "231M": (896, 18, 14),
    "268M": (1024, 16, 16), "302M": (1024, 18, 16), "336M": (1024, 20, 16), "472M": (1280, 18, 10),
    "551M": (1280, 21, 10), "571M": (1408, 18, 11), "629M": (1280, 24, 10), "666M": (1408, 21, 11),
    "761M": (1408, 24, 11), "831M": (1536, 22, 12), "944M": (1536, 25, 12), "1233M": (1792, 24, 14),
    "1476M": (2048, 22, 16), "1678M": (2048, 25, 16), "2121M": (2176, 28, 17),
}


@pytest.mark.parametrize("name", sorted(PAPER_CODE_YAML))
def test_paper_code_name_is_the_preset_of_its_yaml(name):
    p = get_preset(name)
    assert (p.hidden_size, p.num_layers, p.num_attention_heads) == PAPER_CODE_YAML[name]
    assert get_preset(PAPER_CODE_NAMES[name]) == p


def test_aliases_cover_every_table_preset_once():
    assert sorted(PAPER_CODE_NAMES.values(), key=list(PAPER_PRESETS).index) == list(PAPER_PRESETS)
    assert not set(PAPER_CODE_NAMES) & set(PAPER_PRESETS)  # no alias shadows a table name
    for extra in ("717M", "1028"):  # its two yaml files outside the paper's table are not presets
        with pytest.raises(ValueError, match="not a known preset"):
            get_preset(extra)


def test_paper_code_name_selects_the_preset_from_the_command_line():
    cfg = parse_args(["--preset", "2121M"])
    assert cfg.preset() == get_preset("1708M")


def decay_by_name(apply_to_all: bool) -> tuple[dict, dict]:
    """(name -> the weight decay megatron-core's optimizer applies to it, name -> its dim)."""
    from megatron_dllm.model.builder import Architecture, build_model, transformer_config
    from megatron_dllm.model.presets import Preset
    from megatron_dllm.training.optim import build_optimizer, wrap_ddp

    arch = Architecture(Preset(32, 2, 2), 100, 16, "bidirectional")
    config, mlp_config = transformer_config(arch)
    chunks = build_model(arch, config, mlp_config, seed=0)
    model = wrap_ddp(chunks, config, ParallelConfig())
    opt = OptimizerConfig(lr=1e-3, min_lr=1e-4, weight_decay=0.1, apply_wd_to_all_params=apply_to_all)
    optimizer, _ = build_optimizer(model, config, opt, ParallelConfig(), train_iters=1000)
    names = {id(p): n for chunk in model for n, p in chunk.named_parameters()}
    decay = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            decay[names[id(p)]] = group["weight_decay"]
    assert len(decay) == len(names)
    return decay, {n: p.dim() for chunk in model for n, p in chunk.named_parameters()}


def test_weight_decay_groups(world_of_one):
    default, dims = decay_by_name(False)
    exempt = {n for n in dims if n.endswith(".bias") or dims[n] == 1}
    assert exempt and any("norm" in n for n in exempt) and any(n.endswith(".bias") for n in exempt)
    assert {n for n, wd in default.items() if wd == 0.0} == exempt
    assert all(wd == pytest.approx(0.1) for n, wd in default.items() if n not in exempt)
    every, _ = decay_by_name(True)
    assert all(wd == pytest.approx(0.1) for wd in every.values())


@pytest.mark.parametrize("train_iters", [500, 9_999, 10_000, 25_050, 1_234_567])
def test_paper_warmup_length(train_iters):
    paper = int(max(0.01 * train_iters, 100))  # its lr_scheduler: warmup_steps = max(0.01 * max_steps, 100)
    ours = OptimizerConfig(lr_warmup_fraction=0.01, lr_warmup_min_iters=100)
    assert ours.warmup_iters(train_iters) == paper
    # without the bound, Megatron-LM's: the fraction of the decay, not rounded to whole iterations
    assert OptimizerConfig(lr_warmup_fraction=0.01).warmup_iters(train_iters) == 0.01 * train_iters


def test_paper_warmup_in_the_scheduler(world_of_one):
    from megatron_dllm.model.builder import Architecture, build_model, transformer_config
    from megatron_dllm.model.presets import Preset
    from megatron_dllm.training.optim import build_optimizer, wrap_ddp

    arch = Architecture(Preset(32, 2, 2), 100, 16, "bidirectional")
    config, mlp_config = transformer_config(arch)
    model = wrap_ddp(build_model(arch, config, mlp_config, seed=0), config, ParallelConfig())
    opt = OptimizerConfig(lr=1e-3, min_lr=1e-4, lr_warmup_fraction=0.01, lr_warmup_min_iters=100)
    _, scheduler = build_optimizer(model, config, opt, ParallelConfig(), train_iters=3000)  # 1% = 30 < 100
    group = {"max_lr": 1e-3, "min_lr": 1e-4}
    lrs = {}
    for step in (50, 99, 100):
        scheduler.num_steps = step
        lrs[step] = scheduler.get_lr(group)
    assert lrs[50] == pytest.approx(0.5e-3) and lrs[99] < 1e-3 and lrs[100] == pytest.approx(1e-3)


def test_megatron_lm_schedule_lengths(world_of_one):
    """As Megatron-LM's get_optimizer_param_scheduler: --lr-warmup-fraction is a fraction of the
    decay iterations (--lr-decay-iters, else --train-iters); WSD's final decay defaults to the last
    third of what follows the warmup, so the LR holds at its peak from the warmup's end."""
    from megatron_dllm.model.builder import Architecture, build_model, transformer_config
    from megatron_dllm.model.presets import Preset
    from megatron_dllm.training.optim import build_optimizer, wrap_ddp

    assert OptimizerConfig(lr_warmup_fraction=0.1, lr_decay_iters=200).warmup_iters(1000) == 20
    assert OptimizerConfig(lr_warmup_fraction=0.1).warmup_iters(1000) == 100
    arch = Architecture(Preset(32, 2, 2), 100, 16, "bidirectional")
    config, mlp_config = transformer_config(arch)
    model = wrap_ddp(build_model(arch, config, mlp_config, seed=0), config, ParallelConfig())
    opt = OptimizerConfig(lr=1e-3, min_lr=1e-4, lr_warmup_iters=15, lr_decay_style="WSD", lr_decay_iters=60)
    _, scheduler = build_optimizer(model, config, opt, ParallelConfig(), train_iters=300)
    group = {"max_lr": 1e-3, "min_lr": 1e-4}
    lrs = {}
    for step in (15, 16, 45, 60):
        scheduler.num_steps = step
        lrs[step] = scheduler.get_lr(group)
    assert scheduler.wsd_decay_steps == 15  # (60 - 15) // 3
    assert lrs[15] == lrs[16] == lrs[45] == pytest.approx(1e-3) and lrs[60] == pytest.approx(1e-4)


def test_the_lr_at_every_iteration_is_megatron_lms(world_of_one):
    """A warmup fraction that is no whole number of iterations, and WSD without a shape, give the
    LR of Megatron-LM's get_optimizer_param_scheduler (which counts samples; its default
    --lr-wsd-decay-style is exponential) at every iteration."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_dllm.model.builder import Architecture, build_model, transformer_config
    from megatron_dllm.model.presets import Preset
    from megatron_dllm.training.optim import build_optimizer, wrap_ddp

    arch = Architecture(Preset(32, 2, 2), 100, 16, "bidirectional")
    config, mlp_config = transformer_config(arch)
    model = wrap_ddp(build_model(arch, config, mlp_config, seed=0), config, ParallelConfig())
    iters, gbs, group = 12, 4, {"max_lr": 1e-3, "min_lr": 1e-4}
    for opt, warmup_samples, wsd_samples in (
            (OptimizerConfig(lr=1e-3, min_lr=1e-4, lr_warmup_fraction=0.15, lr_decay_style="linear"),
             0.15 * iters * gbs, None),
            (OptimizerConfig(lr=1e-3, min_lr=1e-4, lr_warmup_iters=2, lr_decay_style="WSD", lr_wsd_decay_iters=4),
             2 * gbs, 4 * gbs)):
        optimizer, ours = build_optimizer(model, config, opt, ParallelConfig(), train_iters=iters)
        megatron_lm = OptimizerParamScheduler(
            optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=warmup_samples,
            lr_decay_steps=iters * gbs, lr_decay_style=opt.lr_decay_style, start_wd=0.1, end_wd=0.1,
            wd_incr_steps=iters * gbs, wd_incr_style="constant", wsd_decay_steps=wsd_samples,
            lr_wsd_decay_style="exponential")
        for iteration in range(1, iters + 1):
            ours.num_steps, megatron_lm.num_steps = iteration, iteration * gbs
            assert ours.get_lr(group) == pytest.approx(megatron_lm.get_lr(group), rel=1e-12), (opt, iteration)


def test_warmup_min_iters_refuses_fixed_warmup():
    with pytest.raises(SystemExit) as err:
        parse_args(["--lr-warmup-iters", "10", "--lr-warmup-min-iters", "100"])
    assert err.value.code == 2


def test_recipe_flags_parse():
    cfg = parse_args(["--apply-wd-to-all-params", "--lr-warmup-min-iters", "100"])
    assert cfg.optimizer.apply_wd_to_all_params and cfg.optimizer.lr_warmup_min_iters == 100
    assert not parse_args([]).optimizer.apply_wd_to_all_params
