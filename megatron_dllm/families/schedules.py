"""Noise schedules as functions of t (as in the paper's code).

Every HF export ships this file beside its sampler files (`hf/remote_code.py`), where megatron_dllm
is not installed: it imports torch only (tests/test_hf_generate.py checks the shipped imports).
"""
from __future__ import annotations

import torch


class LogLinear:
    """alpha_t = alpha_0 (1 - (1 - eps) t); sigma = -log alpha_t.

    With t in [eps, 1] this gives 1 - alpha_t = (1 - eps) t and dalpha/(1 - alpha) = -1/t for
    alpha_0 = 1: the MDLM NELBO weight is exactly 1/t.
    """

    name = "loglinear"  # as an HF export's config.json names it

    def __init__(self, eps: float, alpha_0: float = 1.0):
        self.alpha_0, self.eps = alpha_0, eps

    def alpha(self, t: torch.Tensor) -> torch.Tensor:
        return self.alpha_0 * (1 - (1 - self.eps) * t)

    def dalpha(self, t: torch.Tensor) -> torch.Tensor:
        return torch.full_like(t, -self.alpha_0 * (1 - self.eps))

    def sigma(self, t: torch.Tensor) -> torch.Tensor:
        return -torch.log(self.alpha(t))
