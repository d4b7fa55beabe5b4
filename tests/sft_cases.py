"""Shared by tests/test_sft_families.py and tests/sft_worker.py: a tiny SFT batch per family and the
dense reference of its fine-tuning loss (written plainly over full logits)."""
import torch
import torch.nn.functional as F
from test_duo import dense_duo_nelbo

from megatron_dllm.families import Noise, get_family

VOCAB, PADDED, MASK = 50, 64, 49  # ids < 50 incl. [MASK] = 49; TP padding 50..63
B, S = 4, 24
PROMPT_LENGTHS = (3, 7, 1, 10)


def make_case(name: str, seed: int = 0, t_value: float | None = None):
    """(family, clean tokens, prompt mask, ModelInput, logits [s, b, PADDED]) for an SFT batch."""
    gen = torch.Generator().manual_seed(seed)
    family = get_family(name, MASK, VOCAB, "nelbo" if name in ("mdlm", "esolm") else None)
    length = S + int(family.extra_token)
    tokens = torch.randint(0, MASK, (B, length), generator=gen)
    prompt = torch.arange(length)[None, :] < torch.tensor(PROMPT_LENGTHS)[:, None]
    ids = torch.arange(B) + 100 * seed
    inp = family.corrupt(tokens, Noise(seed, ids, strata=ids - ids.min(), num_strata=B), prompt)
    if t_value is not None and name != "ar":
        inp.t = torch.full((B,), t_value)
    logits = 3 * torch.randn(S, B, PADDED, generator=gen)
    return family, tokens, prompt, inp, logits


def _ce(logits_bsv, targets):
    logits = logits_bsv[..., :VOCAB].clone()
    logits[..., MASK] = float("-inf")
    nll = F.cross_entropy(logits.reshape(-1, VOCAB).double(), targets.reshape(-1), reduction="none")
    return nll.view(targets.shape)


def dense_sft_loss(name: str, tokens, prompt, inp, logits_sbv) -> torch.Tensor:
    """The mean SFT loss over response positions, from the clean tokens and prompt mask alone."""
    logits = logits_sbv.transpose(0, 1).double()  # [b, s, V]
    if name == "ar":  # next-token loss on response targets only
        response = ~prompt[:, 1:]
        return (_ce(logits, tokens[:, 1:]) * response).sum() / response.sum()
    response = ~prompt
    t = inp.t.double()[:, None]
    if name == "duo":
        nelbo = dense_duo_nelbo(logits_sbv.double(), inp.input_ids, tokens, inp.t.double())
        return (nelbo * response).sum() / response.sum()
    if name == "esolm":  # back to sequence order: slot i holds position position_ids[:, i]
        order = inp.position_ids
        logits = torch.empty_like(logits).scatter_(1, order[..., None].expand_as(logits), logits)
        z = torch.empty_like(inp.input_ids).scatter_(1, order, inp.input_ids)
    else:
        z = inp.input_ids
    masked = (z == MASK) & response
    return (_ce(logits, tokens) * masked / t).sum() / response.sum()
