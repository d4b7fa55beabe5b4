"""`--attention-backend sdpa` (PyTorch's scaled_dot_product_attention) against megatron-core's own
DotProductAttention (`local`): the core-attention module on its own, a training step of every
family on CPU in fp32 on the DiT and on the GPT backbone (single process here; TP=2 with and
without sequence parallelism under torchrun), and checkpoints across backends. The dense DiT
comparison is in test_reference_dit.py.
"""
import shutil

import pytest
import torch
import torch.nn.functional as F
from attention_cases import FAMILIES, GAIN, LLAMA, MASK_ID, VOCAB, batch, build, compare_backends, rel_diff
from conftest import run_worker_on_two_ranks
from megatron.core import dist_checkpointing
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_dllm import platform
from megatron_dllm.families import get_family
from megatron_dllm.model.attention import SDPAttention, resolve_backend

REL = 1e-6  # relative (Frobenius) difference allowed between the backends in fp32


pytestmark = pytest.mark.usefixtures("world_of_one")  # conftest


def core_config(**overrides) -> TransformerConfig:
    fields = dict(num_layers=3, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                  attention_dropout=0.0, masked_softmax_fusion=False)
    return TransformerConfig(**{**fields, **overrides})


def qkv(sq: int, sk: int, groups: int = 4, seed: int = 0):
    """query [sq, b, 4, 16] and key, value [sk, b, groups, 16], megatron's layout."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(sq, 2, 4, 16, generator=gen), torch.randn(sk, 2, groups, 16, generator=gen),
            torch.randn(sk, 2, groups, 16, generator=gen))


CORE_CASES = {
    "causal": (AttnMaskType.causal, {}, 24, 24, False),
    "bidirectional": (AttnMaskType.no_mask, {}, 24, 24, False),
    "padding mask": (AttnMaskType.padding, {}, 24, 24, True),
    "grouped query": (AttnMaskType.causal, {"num_query_groups": 2}, 24, 24, False),
    "layer scaling": (AttnMaskType.causal, {"apply_query_key_layer_scaling": True}, 24, 24, False),
    "one-query decode": (AttnMaskType.causal, {}, 1, 9, False),
}


@pytest.mark.parametrize("case", CORE_CASES)
def test_core_attention_equals_megatron_dot_product_attention(case):
    """The core-attention contract alone: [s, b, n, d] in, [s, b, n * d] out, forward and backward."""
    mask_type, overrides, sq, sk, with_mask = CORE_CASES[case]
    config = core_config(**overrides)
    # on the platform's device: megatron's DotProductAttention takes its score buffer there
    q, k, v = (t.to(platform.device()) for t in qkv(sq, sk, config.num_query_groups or 4))
    # megatron's mask: True = masked out; the second sample's last 5 keys are padding
    mask = torch.zeros(2, 1, sq, sk, dtype=torch.bool, device=platform.device())
    mask[1, ..., -5:] = True
    outs, grads = [], []
    for cls in (DotProductAttention, SDPAttention):
        module = cls(config, layer_number=3, attn_mask_type=mask_type, attention_type="self")
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = module(*inputs, attention_mask=mask if with_mask else None, attn_mask_type=mask_type)
        out.backward(torch.cos(torch.arange(out.numel(), dtype=out.dtype, device=out.device)).view_as(out))
        outs.append(out.detach())
        grads.append([t.grad for t in inputs])
    assert outs[0].shape == (sq, 2, 64)
    assert rel_diff(outs[1], outs[0]) < REL
    for got, want in zip(grads[1], grads[0]):
        assert rel_diff(got, want) < REL


def test_causal_and_bidirectional_pass_no_mask(monkeypatch):
    """No s x s mask is built: causal is SDPA's is_causal, bidirectional passes nothing."""
    calls, real = [], F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    for attention, causal in (("causal", True), ("bidirectional", False)):
        calls.clear()
        model = build(attention, "sdpa")
        family = get_family("ar" if causal else "mdlm", MASK_ID, VOCAB)
        inp = batch(family)
        model(inp.input_ids, inp.position_ids, inp.sigma)
        assert calls == [(None, causal)] * model.config.num_layers


@pytest.mark.parametrize("family", FAMILIES)
def test_sdpa_training_step_equals_local(family):
    """Logits and every gradient of one training step (Eso-LM: shuffled order, permuted positions)."""
    got = compare_backends(family, "sdpa")
    assert got["logits_scale"] > 1 and got["min_grad_scale"] > 1e-3  # attention shapes the result
    assert got["logits"] < REL and got["grads"] < REL, got


def test_sdpa_with_selective_recompute_equals_local():
    """megatron's selective recompute re-runs the SDPA core attention in backward."""
    got = compare_backends("mdlm", "sdpa", backend_recompute={"recompute_granularity": "selective"})
    assert got["logits"] < REL and got["grads"] < REL, got


@pytest.mark.parametrize("family", FAMILIES)
def test_sdpa_training_step_equals_local_on_the_gpt_backbone(family):
    """The same on the Llama-style backbone (`--backbone gpt`): rope at each token's position ids,
    grouped-query attention, no time conditioning."""
    got = compare_backends(family, "sdpa", gpt=LLAMA)
    assert got["logits_scale"] > 1 and got["min_grad_scale"] > 1e-3
    assert got["logits"] < REL and got["grads"] < REL, got


@pytest.mark.parametrize("family,wrong,gpt", [("mdlm", "causal", None), ("esolm", "bidirectional", None),
                                              ("esolm", "bidirectional", LLAMA)],
                         ids=["mdlm-dit", "esolm-dit", "esolm-gpt"])
def test_a_wrong_attention_layout_exceeds_the_tolerance(family, wrong, gpt):
    """The comparison can fail: the other layout differs by far more than REL."""
    got = compare_backends(family, "sdpa", backend_attention=wrong, gpt=gpt)
    assert got["logits"] > 1e3 * REL and got["grads"] > 1e3 * REL


@pytest.mark.parametrize("saved_with,loaded_with", [("local", "sdpa"), ("sdpa", "local")])
def test_checkpoint_loads_across_backends(saved_with, loaded_with, tmp_path):
    """The model's megatron-core sharded state (what training checkpoints hold) saved under one
    backend loads under the other and gives the same logits."""
    family = get_family("esolm", MASK_ID, VOCAB)
    inp = batch(family)
    saved = build(family.attention, saved_with)
    loaded = build(family.attention, loaded_with, seed=8)  # other weights until the load
    assert saved.sharded_state_dict().keys() == loaded.sharded_state_dict().keys()
    dist_checkpointing.save(saved.sharded_state_dict(), str(tmp_path))
    with torch.no_grad():
        want = saved(inp.input_ids, inp.position_ids, inp.sigma)
        before = loaded(inp.input_ids, inp.position_ids, inp.sigma)
        loaded.load_state_dict(dist_checkpointing.load(loaded.sharded_state_dict(), str(tmp_path)))
        got = loaded(inp.input_ids, inp.position_ids, inp.sigma)
    assert want.abs().max() > GAIN and rel_diff(before, want) > 0.1
    assert rel_diff(got, want) < REL


@pytest.mark.slow
def test_training_resumes_across_backends(pretrain, tmp_path):
    """Through pretrain_dllm.py: a checkpoint written with `local`, resumed with `sdpa`, continues
    the uninterrupted `local` run's losses (Eso-LM: causal over a shuffled order)."""
    run = ["--family", "esolm", "--preset", "cpu-tiny", "--seq-length", "32", "--micro-batch-size", "2",
           "--global-batch-size", "4", "--lr-warmup-iters", "0", "--log-interval", "1", "--eval-interval", "100",
           "--train-iters", "4"]
    full = tmp_path / "full"
    proc, records = pretrain(1, *run, "--attention-backend", "local", "--save", str(full), "--save-interval", "2")
    assert "attention local" in proc.stdout + proc.stderr
    uninterrupted = [r["loss"] for r in records if "loss" in r]
    resumed = tmp_path / "resumed"  # the same run stopped after its iteration-2 checkpoint
    resumed.mkdir()
    shutil.copytree(full / "iter_0000002", resumed / "iter_0000002")
    (resumed / "latest_checkpointed_iteration.txt").write_text("2")
    proc, records = pretrain(1, *run, "--attention-backend", "sdpa", "--load", str(resumed))
    assert "attention sdpa" in proc.stdout + proc.stderr
    assert [r["loss"] for r in records if "loss" in r] == pytest.approx(uninterrupted[2:], rel=1e-6)


def test_backend_choice():
    assert resolve_backend(None, use_te=False) == "local"
    assert resolve_backend("sdpa", use_te=False) == "sdpa"
    if not platform.HAS_TE:
        for name in ("unfused", "fused", "flash", "auto"):
            with pytest.raises(ValueError, match=f"--attention-backend {name} needs TransformerEngine.*sdpa"):
                resolve_backend(name, use_te=False)


def test_unsupported_combinations_are_refused():
    with pytest.raises(ValueError, match="sdpa does not support sliding-window attention"):
        SDPAttention(core_config(window_size=(8, 0)), 1, AttnMaskType.causal, "self")
    module = SDPAttention(core_config(), 1, AttnMaskType.causal, "self")
    with pytest.raises(ValueError, match="causal attention needs as many queries as keys"):
        module(*qkv(4, 9), attention_mask=None)
    with pytest.raises(ValueError, match="packed sequences"):
        module(*qkv(4, 4), attention_mask=None, packed_seq_params=object())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sdpa_equals_local_at_tp2_with_and_without_sequence_parallelism(tmp_path):
    """One 2-rank launch: every family at TP=2, then at TP=2 with sequence parallelism."""
    results = run_worker_on_two_ranks("attention_backend_worker.py", tmp_path)
    assert sorted(results) == sorted(f"{f}/{layout}" for f in FAMILIES for layout in ("TP2", "TP2-SP"))
    for case, ranks in results.items():
        assert len(ranks) == 2, case
        # BD3-LM under SP: rank 1 holds only the clean copy x_0, which no loss reads, so its local
        # gradients of the replicated final-layer weights are 0 (megatron sums them over the ranks)
        live = ranks[:1] if case == "bd3lm/TP2-SP" else ranks
        assert all(got["min_grad_scale"] > 1e-3 for got in live), case
        for got in ranks:
            assert got["logits_scale"] > 1, case
            assert got["logits"] < REL and got["grads"] < REL, (case, got)
