"""Adapting an AR model, in process, on real Trainers over the demo corpus (docs/pretrained-ar.md).

An annealed run (`--attention-mask-anneal-iters`): iteration k's micro-batches get the schedule's
mask of k (Megatron's numbering, the first step is 1), none from N on; a run resumed from its
iteration-2 checkpoint attends and trains exactly as the uninterrupted run (masks and losses bit
for bit); validation is never annealed. An imported AR checkpoint fine-tunes as Eso-LM and MDLM."""
import pytest
import torch
from conftest import TINY_RUN

from megatron_dllm import platform
from megatron_dllm.config import parse_args
from megatron_dllm.training import step
from megatron_dllm.training.attention_anneal import AttentionAnneal
from megatron_dllm.training.trainer import Trainer

N, ITERS, MICRO_BATCHES, SEQ, SEED = 4, 4, 4, 32, 1234  # TINY_RUN: 8 samples in micro-batches of 2
LOSS_FUNC = step.loss_func


def train(flags: list, monkeypatch) -> tuple[list, list]:
    """(training micro-batches' (mask, summed loss) in order, validation micro-batches' masks)."""
    calls, valid = [], []

    def recording(family, training, *args):  # args: (..., inp, logits)
        inp = args[-2]
        total, count, report = LOSS_FUNC(family, training, *args)
        mask = None if inp.attention_mask is None else inp.attention_mask.cpu().clone()
        if training:
            calls.append((mask, total.item()))
        else:
            valid.append(mask)
        return total, count, report

    monkeypatch.setattr(step, "loss_func", recording)
    try:
        Trainer(parse_args(flags)).train()
    finally:
        platform.destroy_distributed()
    return calls, valid


@pytest.mark.slow
def test_annealed_run_resumes_with_the_uninterrupted_masks_and_losses(demo_cache, tmp_path, monkeypatch):
    common = ["--demo-cache-dir", demo_cache, *TINY_RUN, "--seed", str(SEED), "--train-iters", str(ITERS),
              "--attention-mask-anneal-iters", str(N), "--attention-backend", "sdpa", "--eval-iters", "1",
              "--eval-interval", str(ITERS)]
    whole, valid = train([*common, "--save", str(tmp_path / "a"), "--save-interval", "2", "--tensorboard-dir",
                          str(tmp_path / "tb-a")], monkeypatch)
    assert len(whole) == ITERS * MICRO_BATCHES and valid and all(mask is None for mask in valid)
    schedule = AttentionAnneal(N, SEED)
    for i, (mask, _) in enumerate(whole):
        want = schedule.attention_mask(i // MICRO_BATCHES + 1, SEQ)
        assert (mask is None) if want is None else torch.equal(mask, want), i
    assert whole[0][0] is not None and whole[-1][0] is None  # annealed first, the plain layout at N

    resumed, _ = train([*common, "--load", str(tmp_path / "a"), "--ckpt-step", "2", "--save", str(tmp_path / "b"),
                        "--tensorboard-dir", str(tmp_path / "tb-b")], monkeypatch)
    later = whole[2 * MICRO_BATCHES:]
    assert len(resumed) == len(later)
    for (mask, loss), (want_mask, want_loss) in zip(resumed, later, strict=True):
        assert loss == want_loss  # bit for bit
        assert (mask is None and want_mask is None) or torch.equal(mask, want_mask)
    assert later[0][0] is not None  # iteration 3 is still annealed: the resume is not trivially mask-free


@pytest.mark.slow
def test_an_imported_ar_model_fine_tunes_as_eso_lm_and_as_annealed_mdlm(demo_cache, tmp_path, monkeypatch, capsys):
    """A Llama imported as an AR checkpoint (tools/convert_from_hf.py's default family) trains as
    Eso-LM with --finetune, and as MDLM with --shift and annealing: both start from the imported
    weights (the embedding equals the Llama's), their losses are finite and the family change is
    logged (a --finetune of another size is still refused: tests/test_checkpoint_meta.py)."""
    from test_gpt_backbone import tiny_hf

    from megatron_dllm.cli import convert_from_hf
    from megatron_dllm.hf import pretrained_ar

    hf = tiny_hf("llama", tmp_path, vocab_size=4096)  # + the appended [MASK]: the demo tokenizer's 4097
    assert convert_from_hf.main(["--hf", hf, "--save", str(tmp_path / "ar"), "--seq-length", "32"]) == 0
    platform.destroy_distributed()
    gpt = capsys.readouterr().out.split("train it with: ")[1].split()
    embedding = pretrained_ar.read_weights(hf)["model.embed_tokens.weight"]
    common = ["--demo-cache-dir", demo_cache, *TINY_RUN, *gpt, "--train-iters", "2", "--eval-iters", "1",
              "--load", str(tmp_path / "ar"), "--finetune", "--tensorboard-dir", str(tmp_path / "tb")]
    for family in (["--family", "esolm"], ["--family", "mdlm", "--shift", "--attention-mask-anneal-iters", "2",
                                           "--attention-backend", "sdpa"]):
        trainer = Trainer(parse_args([*common, *family, "--save", str(tmp_path / family[1])]))
        try:
            loaded = trainer.model[0].module.embedding.word_embeddings.weight[:4096].detach().cpu()
            assert torch.equal(loaded, embedding)
            losses = [trainer.train_step()[0] for _ in range(2)]
        finally:
            platform.destroy_distributed()
        assert all(loss == loss and 0 < loss < 20 for loss in losses), losses
        assert f"the weights of a --family ar model, trained as --family {family[1]}" in capsys.readouterr().out
