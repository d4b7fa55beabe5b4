"""Eso-LM (alpha_0 = 1): masked diffusion trained with a causal backbone over a shuffled order.

Reference §2.4, diffusion part only (alpha_0 = 1 means no sequential part). The forward process
is MDLM's (LogLinear with alpha_0 = 1; `MDLM.mask` is called, not copied). Each sample is then
shuffled: sort_idx = argsort(is_mask + 0.9 u) puts the clean tokens first and the masked tokens
after, each group in a random order (`families/shuffle.py`: torch reference, C++ and CUDA
kernels, bit-identical). The backbone sees

    input_ids = z_t[sort_idx],  targets = x0[sort_idx],  position_ids = sort_idx,  sigma = 0

with plain causal attention, so each token keeps its original rotary position and a masked token
attends to every clean token, to the masked tokens earlier in the random order, and to itself.
The output at shuffled position i predicts x0 there (no shift). The loss is MDLM's per-token loss
on the shuffled sequence: masked positions only, weight 1 (`low-var`, default) or 1/t (`nelbo`);
validation reports MDLM's NELBO.

The keys u come from `noise.uniform("shuffle", L)`, a pure function of (seed, global sample
index): every TP rank and PP stage builds the same permutation without communication.
`unpermute(x, model_input)` puts a [b, L, ...] tensor in the shuffled order back into sequence
order; the permutation is `model_input.position_ids` itself.
"""
from __future__ import annotations

import torch

from megatron_dllm.families import shuffle as _shuffle
from megatron_dllm.families.base import Family, ModelInput, Noise, response_positions
from megatron_dllm.families.mdlm import MDLM


class EsoLM(Family):
    name = "esolm"
    attention = "causal"
    bound = "MDLM NELBO"
    losses = ("low-var", "nelbo")

    def __init__(self, mask_id: int, vocab_size: int, loss: str | None = None):
        super().__init__(mask_id, vocab_size, loss)
        # The forward process and the per-token losses are MDLM's, on the shuffled sequence.
        self._mdlm = MDLM(mask_id=mask_id, vocab_size=vocab_size, loss=self.loss_type)
        self.schedule = self._mdlm.schedule

    def corrupt(self, tokens: torch.Tensor, noise: Noise, prompt: torch.Tensor | None = None) -> ModelInput:
        z_t, t = self._mdlm.mask(tokens, noise, prompt)
        b, s = tokens.shape
        keys = noise.uniform("shuffle", s)  # float64 [b, s]
        valid = response_positions(tokens, prompt)
        if prompt is not None:
            # SFT: the prompt is the clean prefix of the shuffled order, in sequence order (key 0,
            # ties by index); the clean response tokens follow in random order, the masks last.
            keys = torch.where(prompt.bool(), torch.zeros_like(keys), keys.clamp(min=torch.finfo(keys.dtype).tiny))
        sort_idx, z_sorted, x0_sorted = _shuffle.shuffle(z_t == self.mask_id, keys, z_t, tokens)
        return ModelInput(
            input_ids=z_sorted, position_ids=sort_idx, sigma=torch.zeros(b),
            targets=x0_sorted, valid=valid.gather(1, sort_idx), t=t.float(),
        )

    def loss(self, logits: torch.Tensor, inp: ModelInput) -> torch.Tensor:
        return self._mdlm.loss(logits, inp)

    def nelbo(self, logits: torch.Tensor, inp: ModelInput) -> torch.Tensor:
        return self._mdlm.nelbo(logits, inp)


def unpermute(x: torch.Tensor, inp: ModelInput) -> torch.Tensor:
    """A [b, L, ...] tensor in Eso-LM's shuffled order, back in sequence order.

    `inp.position_ids` is the permutation (shuffled slot i holds sequence position
    position_ids[:, i]), so out[:, position_ids[:, i]] = x[:, i]. Logits come out of the model as
    [s, b, V]: pass `logits.transpose(0, 1)`.
    """
    return _shuffle.unpermute(x, inp.position_ids.to(x.device))
