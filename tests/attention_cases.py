"""Shared by tests/test_attention_backend.py and tests/attention_backend_worker.py: one family's
training step (forward and backward) run on two core-attention backends with the same weights and
the same batch, and the relative differences of their logits and gradients."""
import torch

from megatron_dllm import platform
from megatron_dllm.families import Noise, get_family
from megatron_dllm.model.builder import Architecture, build_model, transformer_config
from megatron_dllm.model.gpt_shape import GPTShape
from megatron_dllm.model.init import initialize_weights
from megatron_dllm.model.presets import Preset

VOCAB, MASK_ID = 300, 299
PRESET = Preset(64, 2, 4)
SEQ, BATCH = 32, 3
FAMILIES = ("ar", "mdlm", "duo", "esolm", "bd3lm")
OPTIONS = {"bd3lm": {"block_size": 8}}  # BD3-LM: an explicit block mask over [x_t ; x_0]
GAIN = 3.0
# the GPT backbone as a Llama: RMSNorm, SwiGLU, rope, no biases, grouped-query attention (2 groups)
LLAMA = GPTShape(ffn_hidden_size=96, num_query_groups=2, normalization="RMSNorm", swiglu=True,
                 position_embedding_type="rope", rotary_base=500, add_bias_linear=False)


def batch(family, seed: int = 0):
    """A corrupted batch as training draws it (Eso-LM: shuffled tokens and permuted positions)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, MASK_ID, (BATCH, SEQ + int(family.extra_token)), generator=gen)
    ids = torch.arange(BATCH)
    return family.corrupt(tokens, Noise(seed, ids, strata=ids, num_strata=BATCH)).to(platform.device())


def train_step(model, family, inp) -> tuple[torch.Tensor, dict]:
    """(logits [s, b, V/tp], grads by parameter name) of one micro-batch's loss."""
    model.zero_grad()
    logits = model(inp.input_ids, inp.position_ids, inp.sigma, inp.attention_mask)
    kept = logits.detach().clone()  # megatron's vocab-parallel cross entropy works in place
    (family.loss(logits, inp).sum() / inp.valid.sum()).backward()
    return kept, {n: p.grad.clone() for n, p in model.named_parameters()}


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (Frobenius)."""
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def build(attention: str, backend: str, tp: int = 1, sequence_parallel: bool = False,
          recompute: dict | None = None, seed: int = 7, fusion=None, gpt: GPTShape | None = None):
    """A small model of an attention layout on `backend` (and `fusion`, builder's default: none),
    with weights that depend on neither the backend, the fusions nor the TP layout; `gpt`: the
    GPT backbone of that shape instead of the DiT."""
    arch = Architecture(PRESET, VOCAB, SEQ, attention, gpt=gpt)
    config, mlp_config = transformer_config(arch, tp=tp, sequence_parallel=sequence_parallel, recompute=recompute,
                                            fusion=fusion)
    model = build_model(arch, config, mlp_config, seed=0, attention_backend=backend)[0]
    initialize_weights(model, seed=seed, adaln_zero=False)  # live gates: gradients reach every layer
    with torch.no_grad():  # larger modulation and head: logits of order 1, attention visible in them
        for n, p in model.named_parameters():
            if "adaLN_modulation" in n or "output_layer" in n:
                p.mul_(GAIN)
    return model


def compare_backends(name: str, backend: str, reference: str = "local", *, tp: int = 1,
                     sequence_parallel: bool = False, backend_attention: str | None = None,
                     backend_recompute: dict | None = None, gpt: GPTShape | None = None) -> dict:
    """Both backends' training step on the same weights and batch: the relative logits difference,
    the worst gradient's, and the sizes that show the comparison is not trivial.
    `backend_attention` gives the tested backend another attention layout (a deliberate fault),
    `backend_recompute` megatron's recompute settings, `gpt` the GPT backbone's shape (None: DiT)."""
    family = get_family(name, MASK_ID, VOCAB, **OPTIONS.get(name, {}))
    inp = batch(family)
    models = {reference: build(family.attention, reference, tp, sequence_parallel, gpt=gpt),
              backend: build(backend_attention or family.attention, backend, tp, sequence_parallel,
                             backend_recompute, gpt=gpt)}
    results = {which: train_step(model, family, inp) for which, model in models.items()}
    (logits_a, grads_a), (logits_b, grads_b) = results[reference], results[backend]
    assert grads_a.keys() == grads_b.keys()  # the same parameters: nothing backend-specific
    return {"logits": rel_diff(logits_b, logits_a),
            "grads": max(rel_diff(grads_b[n], grads_a[n]) for n in grads_a),
            "logits_scale": logits_a.abs().max().item(),
            "min_grad_scale": min(g.abs().max().item() for g in grads_a.values())}
