"""On a CUDA GPU only (skipped elsewhere): bf16 training of every family through pretrain_dllm.py
(and with the 1.7B example's cluster guards, whose decisions go over NCCL, and background saves,
resumed), and the samplers on CUDA (float64 probabilities equal the CPU's; the softmax written
over its input equals one apart; KV caches equal uncached runs; batched conditional generation
equals batch-1 runs). The CUDA Eso-LM shuffle kernel's bit-for-bit test lives in test_esolm.py."""
import math

import pytest
import torch
from test_sampling import FAMILIES, PROMPT, V, random_model

from megatron_dllm.sampling import InferenceModel, SamplingConfig, categorical, generate

pytestmark = pytest.mark.gpu

MASK, L, EOS = V - 1, 24, 0


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_training_of_every_family(family, pretrain):
    iters = 40
    proc, records = pretrain(1, "--family", family, "--bf16", "--train-iters", str(iters), "--log-interval", "10",
                             "--eval-interval", str(iters), "--eval-iters", "2")
    train = [r["loss"] for r in records if "loss" in r]
    valid = [r["valid_nelbo"] for r in records if "valid_nelbo" in r]
    assert len(train) == iters // 10 and len(valid) == 1 and all(map(math.isfinite, train + valid))
    assert train[-1] < train[0], train
    assert valid[-1] < math.log(4097) - 1.0, valid  # the demo tokenizer: 4096 pieces + [MASK]


def test_the_1_7b_cluster_and_checkpoint_flags_save_in_the_background_and_resume_on_the_gpu(pretrain, tmp_path):
    """The 1.7B example's cluster and checkpoint flags on a GPU, where CI cannot run them.
    --exit-signal-handler, --exit-duration-in-mins and --check-for-nan-in-loss-and-grad each take a
    decision over the ranks every iteration (`platform.any_rank`): NCCL refuses the host tensors
    they once used ("No backend type associated with device type cpu"). --async-save writes from a
    process forked after CUDA is initialised, with the distributed optimizer's state; the resumed
    run loads it onto the GPU, the CUDA RNG state with it, and goes on from the next iteration."""
    ckpt = tmp_path / "ckpt"
    recipe = ("--family", "mdlm", "--bf16", "--train-iters", "8", "--log-interval", "1", "--save", str(ckpt),
              "--async-save", "--use-distributed-optimizer", "--overlap-grad-reduce", "--exit-signal-handler",
              "--check-for-nan-in-loss-and-grad", "--max-consecutive-nonfinite-iters", "5",
              "--keep-last-n-checkpoints", "3",
              # the compiled regions are the bf16 training test's: two launches without them compile nothing
              "--no-compile-elementwise", "--no-bias-gelu-fusion")
    proc, records = pretrain(1, *recipe, "--exit-duration-in-mins", "0.001")
    assert "exiting after iteration 1: --exit-duration-in-mins 0.001 reached" in proc.stdout
    (first,) = [r for r in records if "loss" in r]
    assert first["iteration"] == 1 and math.isfinite(first["loss"]) and math.isfinite(first["grad_norm"])
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "1"

    proc, records = pretrain(1, *recipe, "--load", str(ckpt), "--exit-interval", "3")
    assert "at iteration 1: weights, optimizer, RNG" in proc.stdout, proc.stdout[-3000:]
    resumed = [r for r in records if "loss" in r]
    assert [r["iteration"] for r in resumed] == [2, 3]
    assert [r["consumed_samples"] for r in resumed] == [2 * first["consumed_samples"], 3 * first["consumed_samples"]]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in resumed)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"


def _inference(family, device):
    model = random_model(family).double().to(device)
    return InferenceModel(model, family, MASK, V, L, None, "hf")


@pytest.mark.parametrize("family", FAMILIES)
def test_float64_probabilities_equal_the_cpu(family):
    """To float32 resolution, not float64's: the time embedding, the rotary angles and the
    layer-norm statistics run in float32 whatever the model's dtype, as in the reference DiT
    (measured on an H100: at most 1.1e-7 absolute, 1.5e-6 relative)."""
    cpu, gpu = _inference(family, "cpu"), _inference(family, "cuda")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V - 1, (3, L), generator=gen)
    ids[:, 1::3] = MASK
    positions = torch.stack([torch.randperm(L, generator=gen) for _ in range(3)])
    sigma = torch.rand(3, generator=gen, dtype=torch.float64)
    kwargs = dict(input_ids=ids, position_ids=positions, sigma=sigma)
    with torch.no_grad():
        want = cpu.model(**kwargs).logits.softmax(-1)
        got = gpu.model(**{k: v.cuda() for k, v in kwargs.items()}).logits.softmax(-1).cpu()
    assert want.abs().max() > 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("vocab", [1000, 4097, 8192, 32001])
def test_probabilities_written_over_the_logits_copy_equal_a_softmax_apart(vocab, dtype):
    """`categorical.probabilities` writes the softmax over its own copy of the logits: each of CUDA's
    softmax kernels (a warp a row up to 1,024 ids; a block a row, with the row in shared memory where
    it fits, as at 8,192 float64 ids, else read from memory) gives bit for bit the softmax into a
    buffer of its own."""
    gen = torch.Generator("cuda").manual_seed(0)
    logits = (4 * torch.randn(64, vocab, device="cuda", generator=gen)).bfloat16()
    got = categorical.probabilities(logits, dtype, temperature=0.7, suppress=3)
    written = logits.to(dtype) / 0.7
    written[:, 3] = float("-inf")
    assert torch.equal(got, written.softmax(-1))


@pytest.mark.parametrize("family,predictor,steps", [("ar", "ancestral", 16), ("mdlm", "ancestral", 16),
                                                    ("esolm", "ancestral", 7), ("esolm", "block", 4)])
def test_kv_caches_on_cuda_equal_uncached(family, predictor, steps):
    inf = _inference(family, "cuda")
    runs = []
    for kv in (True, False):
        cfg = SamplingConfig(steps=steps, predictor=predictor, kv_cache=kv, eos_id=EOS, stop_at_eos=False)
        runs.append(generate(inf, cfg, num_samples=4, batch_size=2, seed=3, prompt_ids=PROMPT))
    assert torch.equal(runs[0].cpu(), runs[1].cpu())
    assert (runs[0][:, :len(PROMPT)].cpu() == torch.tensor(PROMPT)).all()
    assert len(set(runs[0][:, len(PROMPT):].flatten().tolist())) > 3, "outputs should not be trivial"


def test_a_rank_without_a_gpu_of_its_own_is_named(monkeypatch):
    from megatron_dllm import platform

    rank = torch.cuda.device_count()
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    with pytest.raises(ValueError, match=f"--nproc-per-node: local rank {rank} has no GPU of its own"):
        platform.init_distributed(1, 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_generation_on_cuda_equals_batch_1(family):
    """A batch of prompts of different lengths, each with its own seed, gives on the GPU the
    outputs of batch-1 runs (float64), left to right and native; as test_batched_generation.py on CPU."""
    from megatron_dllm.sampling.conditional import (
        generate_left_to_right,
        generate_left_to_right_batch,
        generate_native,
        generate_native_batch,
    )

    inf = _inference(family, "cuda")
    prompts, seeds = [[5, 6, 7], [9, 3, 4, 12, 8, 11, 2], [20], [14, 15, 16, 17, 18]], [11, 3, 7, 5]
    for single, batched, kw in ((generate_left_to_right, generate_left_to_right_batch, {}),
                                (generate_native, generate_native_batch, {"steps": 5})):
        want = [single(inf, p, 12, EOS, seed=s, greedy=False, **kw) for p, s in zip(prompts, seeds)]
        assert batched(inf, prompts, 12, EOS, greedy=False, seeds=seeds, **kw) == want
