"""Duo: uniform-state diffusion with the closed-form token-level NELBO (as in the paper's code, `DUO_BASE`).

Forward process. With probability 1 - alpha_t (log-linear schedule, eps 1e-3, stratified t) a
token is replaced by one drawn uniformly from the V *real* ids: every id < vocab_size except
[MASK]. The decision and the drawn id come from `Noise.uniform("replace", L)` and
`Noise.uniform("replace_id", L)`, so z_t is a pure function of (seed, global sample index); a
replacement may redraw the clean token itself, as in the reference. The backbone is bidirectional
and gets sigma = -log alpha_t through its adaLN time path.

Choice of V (differs from the reference). The reference draws `randint(0, V)` with V the full
vocabulary *including* [MASK], so noise can emit [MASK] although its logit is -1e6, and its
closed form sums log xbar over V entries, one of which (the mask id) is the constant log(1 - a).
Here the prior, the model's support and the formula agree: V = number of ids a token can take
(vocab_size - 1 with the tokenizer's appended [MASK]), [MASK] never appears in z_t, the [MASK] and
TP-padding logits are suppressed (zero probability), and Σ_j log xbar_theta_j runs over exactly
those V ids — the suppressed columns are excluded explicitly, not left to contribute log(1 - a).

Loss (notation of the paper's code; a = alpha_t, a' = dalpha_t, e = [x == z]):
    xbar_theta = V a x_theta + (1 - a),  xbar_z = (1 - a) + V a e,  c = (1 - a) / (V a + 1 - a)
    term1 = V (1/xbar_z - 1/xbar_theta[z])
    term2 = -(e c + 1 - e)(Σ_j log xbar_theta_j - V log xbar_theta[z])
            - (V a / (1 - a))(log xbar_theta[x] - log xbar_theta[z])(1 - e)
            + ((V - 1) c e - (1 - e)/c) log c
    loss  = (a' / (V a)) (term1 - term2)
`nelbo` is the same bound (per token [b, s]; the trainer divides the sum by valid.sum()).

Vocab-parallel evaluation. With r_j = (V a / (1 - a)) x_theta_j, log xbar_theta_j = log(1 - a) +
log1p(r_j), so only four per-token statistics of the [s, b, V/tp] logits enter the formula:
lse = log Σ_j exp(l_j), S1 = Σ_j log1p(r_j) (the V log(1 - a) part cancels analytically against
V log xbar_theta[z]), and the logits at z and x. `_DuoStats` (a custom autograd function)
computes them shard-locally plus tensor-parallel all-reduces of [s*b]-sized vectors (max, sum-exp,
then S1 with W2 = Σ_j r_j^2/(1 + r_j), then the masked picks at z and x), never gathering logits.
Suppressed columns ([MASK], TP padding; `vocab_parallel.excluded_columns`) are set to -inf
in each fp32 chunk copy, not in the tracked logits, so r = 0 and p = 0 there; they are also
zeroed explicitly before the S1 sum. The backward is analytic, shard-local and needs no
communication (outputs are replicated over TP ranks, so each rank's upstream gradients agree):
    dL/dl_j = g_lse p_j + g_S1 (p_j W2 - r_j^2/(1 + r_j)) + g_lz [j = z] + g_lx [j = x]
(the textbook form g_S1 (w_j - p_j W) with w = r/(1 + r) loses ~3 digits to cancellation at t ~ 1).

Precision and memory. Vocabulary-sized work is fp32 over row chunks of at most `CHUNK_ELEMENTS`
elements (bf16 logits are upcast per chunk), in four passes whose bodies are the functions below
the class (compiled under `--compile-elementwise`: vocab_parallel.compiled_heads); vocabulary
sums accumulate in fp64; the per-token combination runs in fp64 on [s*b] vectors (factors
1/(1 - a) ~ 1e3 and 1/c ~ 4e6 at t = 1e-3).
The forward allocates nothing logits-sized (it saves the logits, which exist anyway), and the
backward writes the gradient over them, chunk by chunk after reading each: beyond the logits the
head needs O(chunk) memory. So the logits hold their gradient after the backward (as with
`vocab_parallel.cross_entropy`): give the loss logits nothing else reads.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_dllm.families import uniform, vocab_parallel
from megatron_dllm.families.base import Family, ModelInput, Noise, response_positions
from megatron_dllm.families.schedules import LogLinear
from megatron_dllm.families.vocab_parallel import chunk_body, fp32_chunk, local_pick, tp_all_reduce
from megatron_dllm.model.constants import T_EPS

# fp32 temporaries per chunk: 16 MiB each. Eagerly about 38 operations per chunk (forward and
# backward): on CPU a dispatch is cheap next to a cache-resident chunk's work; on a GPU each is a
# launch (2,421 per micro-batch of 4 x 2048 at V = 32,001; 441 at 128 MiB), but 16 MiB chunks stay
# in the H100's L2 and 128 MiB ones do not: not yet measured there (benchmarks/RESULTS.md, "Loss
# heads"). Compiled (vocab_parallel.compiled_heads): 4 fused kernels over all rows, no temporaries.
CHUNK_ELEMENTS = 1 << 22


class _DuoStats(torch.autograd.Function):
    """(lse [fp64], S1 [fp64], l_z, l_x) per token from suppressed vocab-parallel logits [rows, V/tp].

    A = V a and B = 1 - a are per-row fp32 constants ([rows]); excluded columns are set to -inf in
    every fp32 chunk (probability exactly 0, gradient exactly 0) and dropped from S1 explicitly.
    """

    @staticmethod
    def forward(ctx, logits2d, z, x, A, B, start, excluded):
        rows, width = logits2d.shape
        dev = logits2d.device
        compiled = ctx.compiled = vocab_parallel.heads_compiled()
        row_max_, row_sum_exp_, row_s1_w2_ = (chunk_body(fn, compiled)
                                              for fn in (_row_max_, _row_sum_exp_, _row_s1_w2_))
        chunks = vocab_parallel.row_chunks(rows, width, CHUNK_ELEMENTS, compiled)
        # 1. global max over the real ids
        m = torch.empty(rows, dtype=torch.float32, device=dev)
        for sl in chunks:
            row_max_(m[sl], logits2d[sl], excluded)
        tp_all_reduce(m, dist.ReduceOp.MAX)
        # 2. global sum of exp(l - m)
        se = torch.empty(rows, dtype=torch.float64, device=dev)  # vocabulary sums accumulate in fp64
        for sl in chunks:
            row_sum_exp_(se[sl], logits2d[sl], m[sl], excluded)
        tp_all_reduce(se)
        lse64 = m.double() + se.log()
        lse = lse64.float()
        # 3. S1 and W2 over the real ids (see `_row_s1_w2_`)
        shift = lse - (A / B).log()
        sw = torch.empty(2, rows, dtype=torch.float64, device=dev)
        for sl in chunks:
            row_s1_w2_(sw[:, sl], logits2d[sl], shift[sl], excluded)
        tp_all_reduce(sw)
        lz = tp_all_reduce(local_pick(logits2d, z, start))
        lx = tp_all_reduce(local_pick(logits2d, x, start))
        ctx.save_for_backward(logits2d, z, x, A, B, shift, sw[1].clone())
        ctx.start, ctx.chunks, ctx.excluded = start, chunks, excluded
        return lse64, sw[0].clone(), lz, lx

    @staticmethod
    def backward(ctx, g_lse, g_s1, g_lz, g_lx):
        logits2d, z, x, A, B, shift, W2 = ctx.saved_tensors
        start, excluded = ctx.start, ctx.excluded
        width = logits2d.shape[1]
        # dS1/dl_j = w_j - p_j W with w_j = r_j / (1 + r_j), W = Σ_k w_k. Since Σ_k p_k = 1,
        # A/B - W = W2, so w_j - p_j W = p_j W2 - r_j^2 / (1 + r_j): no first-order cancellation.
        # grad_j = g_lse p_j + g_S1 (p_j W2 - r_j^2/(1+r_j)) = r_j (k1 - g_S1 r_j / (1 + r_j)).
        g_lse, g_s1 = g_lse.double(), g_s1.double()
        k1 = ((g_lse + g_s1 * W2.double()) * (B.double() / A.double())).float()
        k2 = g_s1.float()
        grad_rows_ = chunk_body(_grad_rows_, ctx.compiled)
        for sl in ctx.chunks:  # each chunk is read (copied to fp32) before its gradient is written over it
            grad_rows_(logits2d[sl], shift[sl], k1[sl], k2[sl], excluded)
        grad = logits2d  # the terms at z and x follow
        for ids, g in ((z, g_lz), (x, g_lx)):
            local = ids - start
            owned = (local >= 0) & (local < width)
            idx = local.clamp(0, width - 1)[:, None]
            grad.scatter_add_(1, idx, torch.where(owned, g.float(), torch.zeros_like(g.float()))[:, None]
                              .to(grad.dtype))
        return grad, None, None, None, None, None, None


# The chunk bodies of _DuoStats, functions of a chunk of rows of the logits that write their
# results in place (compiled, into the kernel's own stores): eager, or compiled inside
# vocab_parallel.compiled_heads(). With shift = lse - log(A/B), r_j = exp(l_j - shift).

def _row_max_(m, rows, excluded):
    m.copy_(fp32_chunk(rows, excluded).amax(1))


def _row_sum_exp_(se, rows, m, excluded):
    se.copy_(fp32_chunk(rows, excluded).sub_(m[:, None]).exp_().sum(1, dtype=torch.float64))


def _row_s1_w2_(sw, rows, shift, excluded):
    """sw[0] = S1 = Σ_j log1p(r_j) with r_j = (A/B) p_j, and sw[1] = W2 = Σ_j r_j^2 / (1 + r_j),
    over the real ids. log xbar_j = log B + log1p(r_j): the V log B part is added analytically."""
    ratio = fp32_chunk(rows, excluded).sub_(shift[:, None]).exp_()
    tmp = torch.log1p(ratio)
    for lo, hi in excluded:  # already 0 there (p = 0); dropped explicitly all the same
        tmp[:, lo:hi] = 0.0
    sw[0].copy_(tmp.sum(1, dtype=torch.float64))
    torch.div(ratio, ratio + 1.0, out=tmp)
    sw[1].copy_(tmp.mul_(ratio).sum(1, dtype=torch.float64))


def _grad_rows_(rows, shift, k1, k2, excluded):
    """Writes r_j (k1 - k2 r_j / (1 + r_j)) over the rows: the gradient, before its terms at z and x."""
    ratio = fp32_chunk(rows, excluded).sub_(shift[:, None]).exp_()
    tmp = ratio + 1.0
    torch.div(ratio, tmp, out=tmp)
    rows.copy_(tmp.mul_(-k2[:, None]).add_(k1[:, None]).mul_(ratio))


class Duo(Family):
    name = "duo"
    attention = "bidirectional"
    bound = "Duo NELBO"
    losses = ("nelbo",)
    schedule = LogLinear(T_EPS)

    @property
    def num_real(self) -> int:
        """V: the number of ids a token can take (all ids < vocab_size except [MASK])."""
        return uniform.num_real(self.mask_id, self.vocab_size)

    def replace(self, tokens: torch.Tensor, noise: Noise, prompt: torch.Tensor | None = None):
        """(z_t, t, replaced): with probability 1 - alpha_t a token is redrawn uniformly from the
        V real ids ([MASK] skipped); `replaced` marks the decisions (a redraw may equal x).
        Prompt tokens (SFT) are never redrawn."""
        t = noise.t()
        length = tokens.shape[1]
        z_t, replaced = self.replace_at(tokens, t[:, None], noise.uniform("replace", length),
                                        noise.uniform("replace_id", length), prompt)
        return z_t, t, replaced

    def replace_at(self, tokens: torch.Tensor, t: torch.Tensor, u: torch.Tensor, u_id: torch.Tensor,
                   prompt: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(z_t, replaced) for times t ([b, 1] or per token [b, L]) and uniform draws u, u_id [b, L]."""
        replaced = u < 1 - self.schedule.alpha(t)
        if prompt is not None:
            replaced &= ~prompt.bool()
        return torch.where(replaced, uniform.real_ids(u_id, self.mask_id, self.vocab_size), tokens), replaced

    def corrupt(self, tokens: torch.Tensor, noise: Noise, prompt: torch.Tensor | None = None) -> ModelInput:
        z_t, t, _ = self.replace(tokens, noise, prompt)
        b, s = tokens.shape
        return ModelInput(
            input_ids=z_t, position_ids=torch.arange(s).expand(b, s), sigma=self.schedule.sigma(t).float(),
            targets=tokens, valid=response_positions(tokens, prompt), t=t.float(),
        )

    def nelbo(self, logits: torch.Tensor, inp: ModelInput) -> torch.Tensor:
        s, b, width = logits.shape
        V = self.num_real
        # [MASK] and TP padding are suppressed inside _DuoStats (vocab_parallel.excluded_columns)
        start, _ = vocab_parallel.local_vocab_range(logits)
        excluded = vocab_parallel.excluded_columns(logits, self.mask_id, self.vocab_size)

        t = inp.t.to(device=logits.device, dtype=torch.float64)
        t = (t if t.dim() == 2 else t[:, None].expand(b, s)).t()  # [s, b]: per token (BD3-LM) or sequence
        a = self.schedule.alpha(t)                       # rows are (s, b)-ordered
        da = self.schedule.dalpha(t)
        A64, B64 = V * a, 1 - a
        z = inp.input_ids.t().reshape(-1).to(logits.device)
        x = inp.targets.t().reshape(-1).to(logits.device)
        lse, s1, lz, lx = _DuoStats.apply(
            logits.reshape(s * b, width), z, x, A64.reshape(-1).float().contiguous(),
            B64.reshape(-1).float().contiguous(), start, excluded)

        # per-token combination, float64 on [s*b]; log xbar_theta[k] = log B + log1p(r_k)
        A, B = A64.reshape(-1), B64.reshape(-1)
        lse, s1, lz, lx = (v.double() for v in (lse, s1, lz, lx))
        log_ratio = torch.log(A) - torch.log(B)
        l1p_z = torch.log1p(torch.exp(lz - lse + log_ratio))
        l1p_x = torch.log1p(torch.exp(lx - lse + log_ratio))
        e = (x == z).double()
        xbar_z = B + A * e
        c = B / (A + B)
        term1 = V * (1 / xbar_z - torch.exp(-l1p_z) / B)
        # Σ_j log xbar_j - V log xbar_z = S1 - V log1p(r_z): the V log B terms cancel exactly
        term2 = (-(e * c + 1 - e) * (s1 - V * l1p_z)
                 - (A / B) * (l1p_x - l1p_z) * (1 - e)
                 + ((V - 1) * c * e - (1 - e) / c) * torch.log(c))
        loss = (da.reshape(-1) / A) * (term1 - term2)
        loss = loss.view(s, b).t().to(torch.float32)
        return loss * inp.valid.to(loss.device)

    def loss(self, logits: torch.Tensor, inp: ModelInput) -> torch.Tensor:
        return self.nelbo(logits, inp)

