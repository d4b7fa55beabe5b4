"""What every family's sampler shares: settings checks, the [b, L] canvas with the prompt in front,
the denoiser's probabilities, the diffusion time grid, left-to-right filling and EOS stopping.

A sampler turns a prompt [b, P] (P may be 0) into a full sequence [b, L] whose first P tokens are
the prompt, unchanged. All randomness comes from the generator passed to `sample`.
"""
from __future__ import annotations

import math

import torch

from . import categorical
from .approx_kv_cache import BlockDenoiser
from .blocks import block_spans, each_block, end_at_eos
from .config import REMASKING_PREDICTORS, SamplingConfig
from .cuda_graphs import graphed
from .deps import InputError, KVCache
from .positions import flat_positions
from .prompt_batch import PromptBatch
from .shifted_model import ShiftedModel

FINAL_T = 1e-5  # last diffusion time of the grid linspace(1, 1e-5, T + 1) (as in the paper's code)


class EosStop:
    """Left-to-right stopping: once a row has emitted EOS it only emits EOS; `done` when all have.

    On a GPU, reading `finished` at every step would make the host wait for the step's kernels:
    instead each step copies `finished.all()` to pinned host memory without waiting, and `done`
    reads the copy once the GPU has passed it. So `done` may come a step or two late, which
    changes nothing: finished rows only emit EOS, and the caller fills the rest with EOS."""

    def __init__(self, eos_id: int | None, rows: int, enabled: bool, device):
        self.eos_id = eos_id
        self.enabled = enabled and eos_id is not None
        self.finished = torch.zeros(rows, dtype=torch.bool, device=device)
        self.copied = None  # on CUDA: (pinned copy of finished.all(), the event after the copy)
        if self.enabled and self.finished.is_cuda:
            self.copied = (torch.zeros((), dtype=torch.bool).pin_memory(), torch.cuda.Event())

    def __call__(self, new: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return new
        new = torch.where(self.finished, torch.full_like(new, self.eos_id), new)
        self.finished |= new == self.eos_id
        if self.copied is not None:
            flag, event = self.copied
            flag.copy_(self.finished.all(), non_blocking=True)
            event.record()
        return new

    @property
    def done(self) -> bool:
        if not self.enabled:
            return False
        if self.copied is None:
            return bool(self.finished.all())
        flag, event = self.copied
        return event.query() and bool(flag)


class Sampler:
    """Base of the family samplers; a subclass implements `sample(prompt, generator)`."""

    predictors: tuple[str, ...] = ("ancestral", "left-to-right")
    # AR/Eso-LM KV caches: preallocated to the run's final length and written in place; False
    # grows them by concatenation per step (the earlier cache: benchmarks and tests compare them)
    static_kv_cache: bool = True
    # AR/Eso-LM: fixed-shape KV caches and Eso-LM slices padded to power-of-two widths, so that a
    # step's forward has the shapes of the steps before it; `cuda_graphs` needs them (tests turn
    # them on without a GPU to compare them with the static cache)
    fixed_shape_decoding: bool = False
    block_wise = False  # MDLM/Duo: block-wise decoding and its approximate KV caches
    noise_removal_step = False  # MDLM/Duo ancestral: a final step at t = 1e-5 (SamplingConfig.noise_removal)
    open_ended = False  # BD3-LM: generates --max-new-tokens past the prompt, block by block

    def __init__(self, family, inf, cfg: SamplingConfig):
        cfg.check()
        if cfg.predictor not in self.predictors:
            from .remasking import REMASKING_SAMPLERS  # here: remasking.py builds on this module

            valid = [*self.predictors, *(REMASKING_PREDICTORS if inf.family in REMASKING_SAMPLERS else ())]
            raise InputError(f"--predictor {cfg.predictor} is not available for --family {inf.family}; "
                             f"valid: {', '.join(valid)}")
        if cfg.max_new_tokens is not None and not self.open_ended:
            raise InputError(f"--max-new-tokens applies to --family bd3lm only; --family {inf.family} fills "
                             f"--seq-length")
        if cfg.noise_removal != "greedy" and not (self.noise_removal_step and cfg.predictor == "ancestral"):
            raise InputError(f"--noise-removal {cfg.noise_removal}: the final step of the ancestral samplers of "
                             f"mdlm, duo and bd3lm; --family {inf.family} --predictor {cfg.predictor} has none")
        self.check_block_wise(inf.family, cfg)
        self.check_shift(family, cfg)
        self.family, self.inf, self.cfg = family, inf, cfg
        model = graphed(inf.model) if cfg.cuda_graphs else inf.model
        self.model = ShiftedModel(model) if family.shift else model
        self.fixed_shape = cfg.cuda_graphs or self.fixed_shape_decoding
        self.mask_id = inf.mask_id
        self.dtype = categorical.precision(cfg.float64)
        self.length = cfg.seq_length or inf.seq_length
        if self.length > inf.seq_length:
            raise InputError(f"--seq-length {self.length} exceeds the model's context {inf.seq_length}")
        tokenizer_eos = getattr(inf.tokenizer, "eod", None)
        self.eos_id = cfg.eos_id if cfg.eos_id is not None else tokenizer_eos

    def check_block_wise(self, family: str, cfg: SamplingConfig) -> None:
        flags = [f for f, on in (("--block-length", cfg.block_length is not None),
                                 (f"--approx-kv-cache {cfg.approx_kv_cache}", cfg.approx_kv_cache != "none")) if on]
        if flags and not self.block_wise:
            raise InputError(f"{' and '.join(flags)}: block-wise decoding and its approximate KV caches are for "
                             f"MDLM and Duo; --family {family} decodes causally with an exact KV cache (--kv-cache)")
        if flags and cfg.predictor == "left-to-right":
            raise InputError(f"{' and '.join(flags)}: block-wise decoding runs the ancestral sampler, not "
                             f"--predictor left-to-right")

    @staticmethod
    def check_shift(family, cfg: SamplingConfig) -> None:
        """A shifted model's logits at a position come from the one before it, which an approximate
        KV cache's window (the current block, or the block and what follows) does not compute."""
        if family.shift and cfg.approx_kv_cache != "none":
            raise InputError(f"--approx-kv-cache {cfg.approx_kv_cache}: this model was trained with --shift (the "
                             f"logits at i - 1 predict token i), which a cached window cannot apply; use "
                             f"--approx-kv-cache none")

    @property
    def blocks(self) -> bool:
        """Whether this run decodes block-wise (a block length or an approximate cache given)."""
        return self.cfg.block_length is not None or self.cfg.approx_kv_cache != "none"

    def sample_rows(self, prompt: torch.Tensor, generator: torch.Generator, length: int | None = None) -> torch.Tensor:
        """`sample` through `sample_batch`: the rows of `prompt` [b, P] at `length` (default: this
        sampler's), all drawing from the one generator, row after row. [b, length]."""
        b, p = prompt.shape
        length = length or self.length
        batch = PromptBatch(prompt.tolist(), [length] * b, [generator] * b, prompt.device)
        out = torch.tensor(self.sample_batch(batch), dtype=torch.long, device=prompt.device)
        return torch.cat([prompt, out.reshape(b, length - p)], dim=1)

    # ------------------------------------------------------------------ pieces for subclasses

    def kv_cache_length(self, tokens: int) -> int | None:
        """`max_length` of a KV cache that holds at most `tokens` entries (None: a growing cache)."""
        return tokens if self.static_kv_cache else None

    def kv_cache(self, tokens: int) -> KVCache:
        """A KV cache for one `sample` call that holds at most `tokens` entries: fixed-shape (CUDA
        graphs), static or growing."""
        layers = self.model.config.num_layers
        if self.fixed_shape:
            return KVCache(layers, tokens, fixed_shape=True, device=self.inf.device)
        return KVCache(layers, self.kv_cache_length(tokens))

    def canvas(self, prompt: torch.Tensor, filler: torch.Tensor | None = None) -> torch.Tensor:
        """[b, L]: the prompt, then `filler` ([b, L - P]; default [MASK])."""
        b, p = prompt.shape
        x = torch.full((b, self.length), self.mask_id, dtype=torch.long, device=prompt.device)
        x[:, :p] = prompt
        if filler is not None:
            x[:, p:] = filler
        return x

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The model's distribution in the sampling dtype: temperature, [MASK] suppressed, top-p."""
        return categorical.probabilities(logits, self.dtype, self.cfg.temperature, self.cfg.top_p,
                                         suppress=self.mask_id)

    def draw(self, logits: torch.Tensor, generator: torch.Generator, at: torch.Tensor | None = None):
        """One id per row of logits [..., V] from `probs`'s distribution (`categorical.draw`, a
        chunk of rows at a time; with `at`, also each row's probability of its id there)."""
        return categorical.draw(logits, self.dtype, generator, self.cfg.temperature, self.cfg.top_p,
                                suppress=self.mask_id, at=at)

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """The most likely id per row of logits [..., V] under `probs` ([MASK] never), without
        forming the distribution (`categorical.greedy`)."""
        return categorical.greedy(logits, self.mask_id)

    def draw_rows(self, logits: torch.Tensor, batch, rows: torch.Tensor) -> torch.Tensor:
        """One id per row of logits [n, V]; row j draws from the generator of batch row rows[j]."""
        return torch.cat([self.draw(logits[j:j + 1], batch.generators[int(r)]) for j, r in enumerate(rows)])

    def timesteps(self) -> list[float]:
        return torch.linspace(1.0, FINAL_T, self.cfg.steps + 1, dtype=torch.float64).tolist()

    def alpha(self, t: float) -> float:
        return float(self.family.schedule.alpha(torch.tensor(t, dtype=torch.float64)))

    def logits_at_column(self, x: torch.Tensor, pos: int, **inputs) -> torch.Tensor:
        """The model's logits [b, V] at position `pos` of every row of x [b, s], the output layer run
        only there."""
        b, s = x.shape
        if s == 1:  # a cached decoding step: nothing to leave out
            return self.model(input_ids=x, **inputs).logits[:, 0]
        column = torch.full((b, 1), pos, device=x.device)
        return self.model(input_ids=x, logits_at=flat_positions(column, s), **inputs).logits

    def batch_logits(self, x: torch.Tensor, real: torch.Tensor, rows: torch.Tensor, columns,
                     alphas: list[float] | None = None) -> torch.Tensor:
        """Logits [n, V] at each batch row's `columns` (as `flat_positions` takes them, one entry per
        row of `rows`), the rows cut to their longest canvas, padding unseen; `alphas`: the time
        input per row (Duo's; None for a model that has none)."""
        width = int(real[rows].sum(1).max())
        sigma = None if alphas is None else torch.tensor([-math.log(a) for a in alphas], device=x.device)
        return self.model(input_ids=x[rows, :width], sigma=sigma, attention_mask=real[rows, :width],
                          logits_at=flat_positions(columns, width)).logits

    def end_rows_at_eos(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """`stop_at_eos` for a sampler that decodes every position together: each row after its
        first EOS from `start` on becomes EOS, as a left-to-right row stops there (and as block-wise
        decoding with one block does)."""
        if self.cfg.stop_at_eos:
            for r in range(x.shape[0]):
                end_at_eos(x, r, start, x.shape[1], x.shape[1], self.eos_id)
        return x

    def fill_left_to_right(self, x: torch.Tensor, start: int, generator, logits_at) -> torch.Tensor:
        """One position per step from `start` on: sample from `logits_at(x, pos)` ([b, V]) there."""
        stop = EosStop(self.eos_id, x.shape[0], self.cfg.stop_at_eos, x.device)
        for pos in range(start, self.length):
            x[:, pos] = stop(self.draw(logits_at(x, pos), generator))
            if stop.done:
                x[:, pos + 1:] = self.eos_id
                break
        return x

    def fill_batch_left_to_right(self, batch, next_logits) -> list[list[int]]:
        """Batched `fill_left_to_right` over a `PromptBatch`: each row fills its positions from its
        prompt length on, one per step, drawing from its own generator; a row leaves the batch at
        its canvas end or (stop_at_eos) at its first EOS, so finished rows cost nothing.
        `next_logits(rows, pos, last)` gives the logits [n, V] at positions `pos` of the batch rows
        `rows`, after writing `last` (the ids just drawn at pos - 1; None at the first step).
        Returns the ids drawn per row (EOS included, nothing after it)."""
        stop_at_eos = self.cfg.stop_at_eos and self.eos_id is not None
        rows = torch.arange(batch.size, device=batch.device)
        pos, lengths = batch.prompt_lengths(), batch.canvas_lengths()
        out: list[list[int]] = [[] for _ in range(batch.size)]
        last = None
        while len(rows):
            last = self.draw_rows(next_logits(rows, pos, last), batch, rows)
            for r, token in zip(rows.tolist(), last.tolist()):
                out[r].append(token)
            going = pos + 1 < lengths[rows]
            if stop_at_eos:
                going &= last != self.eos_id
            rows, pos, last = rows[going], pos[going] + 1, last[going]
        return out

    def batch_blocks(self, batch, x: torch.Tensor, real: torch.Tensor):
        """Block-wise decoding of a `PromptBatch`'s canvas `x` (positions `real`): yields each block
        in turn as (rows, span, denoiser): the rows that reach it, their (lo, hi) per row and the
        denoiser, its cache started for the block. Once the caller has decoded the block, a row whose
        block holds an EOS ends there (stop_at_eos)."""
        plen = batch.prompt_lengths().tolist()
        spans = [block_spans(p, n, self.cfg.block_length) for p, n in zip(plen, batch.lengths)]
        denoiser = BlockDenoiser(self.model, self.cfg.approx_kv_cache, x, real)
        ended = [False] * batch.size
        for k, rows in each_block(spans, ended):
            span = {r: spans[r][k] for r in rows}
            denoiser.start_block(rows)
            yield rows, span, denoiser
            for r in rows:
                ended[r] = self.cfg.stop_at_eos and end_at_eos(x, r, *span[r], batch.lengths[r], self.eos_id)

    def sample(self, prompt: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        raise NotImplementedError

    def sample_batch(self, batch) -> list[list[int]]:
        """Conditional generation for a `PromptBatch` (prompts of different lengths, one generator
        per row): the ids generated after each prompt; row i equals `sample` on prompt i alone
        with row i's generator and canvas length. Each family implements it in its own file."""
        raise NotImplementedError
