"""Fixed-shape decoding and CUDA graphs for the samplers (`KVCache(fixed_shape=True)`,
sampling/cuda_graphs.py). On CPU, in float64: the fixed-shape cache gives the static cache's
logits and the same samples (Eso-LM's padded slices included), and a decoding step traces as one
graph at every cache length (TorchDynamo, fullgraph, no recompilation: nothing on the host reads
the length), which the static cache does not; `cuda_graphs` is refused off CUDA; `CUDAGraphModel`
with an eager stand-in for its graphs gives the eager samples and runs the output layer only at
the drawn rows; a compiled model (`InferenceModel.compile()`, TorchInductor) gives the eager
samples from a few graphs. On a GPU:
graphed samples, and graphed compiled ones, equal eager ones for every family, and the graphs are
replayed. On both: stopping at EOS (on CUDA without waiting for the GPU) gives the full run cut at
each row's first EOS."""
import pytest
import torch
from test_kv_caches import CHUNKS, L, ids_and_positions, incremental_logits, models  # noqa: F401 (the fixture)
from test_sampling import EOS, MASK, PROMPT, V, count_rows_drawn, random_model

from megatron_dllm.errors import InputError
from megatron_dllm.hf.modeling_dllm import KVCache
from megatron_dllm.sampling import InferenceModel, SamplingConfig, generate, get_sampler
from megatron_dllm.sampling import base as sampling_base
from megatron_dllm.sampling.base import Sampler
from megatron_dllm.sampling.cuda_graphs import CUDAGraphModel

CASES = [("ar", "ancestral", 1), ("esolm", "ancestral", 9), ("esolm", "block", 4), ("esolm", "left-to-right", 1)]


@pytest.mark.parametrize("family", ["ar", "esolm"])
def test_fixed_shape_cache_logits_equal_the_static_cache(models, family):  # noqa: F811
    model = models[family].model
    x, positions = ids_and_positions(family)
    layers = model.config.num_layers
    static = incremental_logits(model, x, positions, KVCache(layers, L), CHUNKS)
    fixed = KVCache(layers, L, fixed_shape=True)
    for s, f in zip(static, incremental_logits(model, x, positions, fixed, CHUNKS)):
        torch.testing.assert_close(f, s, rtol=0, atol=1e-12)
    assert fixed.keys[0].shape[2] == L and len(fixed) == sum(keep for _, keep in CHUNKS)


@pytest.mark.parametrize("family,predictor,steps", CASES)
def test_fixed_shape_decoding_gives_the_static_caches_samples(models, monkeypatch, family, predictor, steps):  # noqa: F811
    def run():
        cfg = SamplingConfig(steps=steps, predictor=predictor, eos_id=EOS, stop_at_eos=False)
        return generate(models[family], cfg, num_samples=4, batch_size=2, seed=7, prompt_ids=PROMPT)

    static = run()
    monkeypatch.setattr(Sampler, "fixed_shape_decoding", True)
    assert torch.equal(run(), static)


def decoding_steps(model, cache, family):
    """(ids, positions, keep) of 5 cached steps of one width after a prefill of 4 tokens: AR one
    token each; Eso-LM a slice of 4 that keeps 1 to 3 (the count varies, the shape does not)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, V - 1, (2, L), generator=gen)
    order = torch.stack([torch.randperm(L, generator=gen) for _ in range(2)])
    model(input_ids=x[:, :4], position_ids=order[:, :4], kv_cache=cache)
    steps, at = [], 4
    for keep in (1, 3, 2, 1, 3):
        width = 1 if family == "ar" else 4
        steps.append((x[:, at:at + width], order[:, at:at + width], torch.tensor(keep if family == "esolm" else 1)))
        at += int(steps[-1][2])
    return steps


@pytest.mark.parametrize("family", ["ar", "esolm"])
def test_a_fixed_shape_step_traces_once_at_every_cache_length(models, family):  # noqa: F811
    """Dynamo records a forward once per set of guards; with error_on_recompile, a step whose host
    code read the cache's length (a Python int: the static cache) fails at the second length."""
    import torch._dynamo

    model = models[family].model
    layers = model.config.num_layers

    def compiled_run(cache):
        torch._dynamo.reset()
        step = torch.compile(lambda ids, pos, keep: model(input_ids=ids, position_ids=pos, kv_cache=cache,
                                                          kv_keep=keep).logits,
                             backend="eager", fullgraph=True, dynamic=False)
        with torch._dynamo.config.patch(error_on_recompile=True):
            return [step(*args) for args in decoding_steps(model, cache, family)]

    want = [model(input_ids=ids, position_ids=pos, kv_cache=cache, kv_keep=int(keep)).logits
            for cache in [KVCache(layers, L)] for ids, pos, keep in decoding_steps(model, cache, family)]
    for got, ref in zip(compiled_run(KVCache(layers, L, fixed_shape=True)), want):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    with pytest.raises(torch._dynamo.exc.RecompileError):
        compiled_run(KVCache(layers, L))
    torch._dynamo.reset()


@pytest.mark.slow
def test_an_inductor_compiled_fixed_shape_cache_leaves_a_tensor_kv_keep_alone(models):  # noqa: F811
    """TorchInductor (CPU), a tensor `kv_keep` from a fresh cache's first forward on, as Eso-LM's
    sampler passes under CUDA graphs (one tensor per value, kept across steps and samples): the
    cache counts what it keeps and `kv_keep` stays as given. A count made inside the first forward
    was 0 + kv_keep, which Inductor folds to kv_keep itself, so the cache then advanced kv_keep in
    place and the next sample wrote past the cache's end (an index-out-of-bounds assert)."""
    import torch._dynamo

    model = models["esolm"].model
    layers = model.config.num_layers
    x, positions = ids_and_positions("esolm")
    chunks = [(4, 4), (20, 4)]  # the second slice reaches the cache's end
    want = incremental_logits(model, x, positions, KVCache(layers, L), chunks)
    keep = torch.tensor(4)
    torch._dynamo.reset()
    compiled = torch.compile(model)
    for _ in range(2):  # two samples
        cache = KVCache(layers, L, fixed_shape=True)
        at = 0
        for (size, _), ref in zip(chunks, want):
            got = compiled(input_ids=x[:, at:at + size], position_ids=positions[:, at:at + size], kv_cache=cache,
                           kv_keep=keep).logits
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)  # float32 rotary and norms, fused
            at += 4
        assert int(keep) == 4 and len(cache) == 8
    torch._dynamo.reset()


def test_cuda_graphs_are_refused_off_cuda(models):  # noqa: F811
    with pytest.raises(InputError, match="--cuda-graphs: CUDA graphs need the model on a CUDA device; it is on cpu"):
        get_sampler(models["ar"], SamplingConfig(cuda_graphs=True))


class EagerReplay:
    """A CUDA graph's stand-in on CPU: its capture runs the forward on its own buffers for the
    output tensor and puts the KV cache's length back (a capture records kernels without running
    them), and each replay runs the forward again into that tensor, as a graph's kernels do."""

    def __init__(self, forward, tensors: dict, cache):
        self.buffers = {name: tensor.clone() for name, tensor in tensors.items()}
        filled = None if cache is None else cache.filled.clone()
        self.forward, self.logits, self.replays = forward, forward(self.buffers), 0
        if filled is not None:
            cache.filled.copy_(filled)

    def replay(self):
        self.logits.copy_(self.forward(self.buffers))
        self.replays += 1


GRAPH_CASES = CASES + [("mdlm", "ancestral", 16), ("duo", "ancestral", 8), ("mdlm", "left-to-right", 1),
                       ("duo", "left-to-right", 1)]


@pytest.mark.parametrize("family,predictor,steps", GRAPH_CASES)
def test_graphed_forwards_give_the_eager_samples_and_run_the_output_layer_where_drawn(family, predictor, steps,
                                                                                      monkeypatch):
    """`CUDAGraphModel`'s own logic on CPU, its graphs replayed by a stand-in (real graphs: the GPU
    test below). Samples equal eager fixed-shape decoding's (float64), forwards are captured and
    replayed, and the output layer runs only at the rows a step draws from, padded to a power of
    two, not at every position of the graph's input."""
    graphs = []

    def capture(self, tensors):
        graphs.append(EagerReplay(self.forward, tensors, self.cache))
        return graphs[-1], graphs[-1].buffers, graphs[-1].logits

    monkeypatch.setattr(CUDAGraphModel, "capture", capture)
    monkeypatch.setattr(sampling_base, "graphed", CUDAGraphModel)  # which refuses a model off CUDA
    monkeypatch.setattr(Sampler, "fixed_shape_decoding", True)
    inf = InferenceModel(random_model(family).double(), family, MASK, V, L, None, "hf")
    head_rows, drawn_rows = [], []
    inf.model.get_output_embeddings().register_forward_pre_hook(
        lambda module, args: head_rows.append(args[0].shape[:-1].numel()))
    runs = []
    for cuda_graphs in (False, True):
        sampler = get_sampler(inf, SamplingConfig(steps=steps, predictor=predictor, eos_id=EOS, stop_at_eos=False,
                                                  cuda_graphs=cuda_graphs))
        count_rows_drawn(sampler, drawn_rows)
        head_rows.clear(), drawn_rows.clear()
        with torch.no_grad():
            runs.append(sampler.sample(torch.tensor([PROMPT, PROMPT]), torch.Generator().manual_seed(3)))
    assert torch.equal(runs[0], runs[1])
    assert graphs and sum(g.replays for g in graphs) > 0
    assert set(head_rows) == {1 << (rows - 1).bit_length() for rows in drawn_rows}, (head_rows, drawn_rows)


@pytest.mark.gpu
@pytest.mark.parametrize("family,predictor,steps", GRAPH_CASES)
def test_cuda_graph_samples_equal_eager_ones(family, predictor, steps, monkeypatch):
    """Replays run the kernels of the eager fixed-shape forward on the same inputs, so the samples
    are equal exactly (float64, as the other CUDA sampling tests). A compiled model's replays run
    Triton's fused kernels instead: equal samples too (its float32 parts round differently, far
    below what moves a float64 draw)."""
    inf = InferenceModel(random_model(family).double().cuda(), family, MASK, V, L, None, "hf")
    monkeypatch.setattr(Sampler, "fixed_shape_decoding", True)
    captured = []
    monkeypatch.setattr(CUDAGraphModel, "capture", lambda self, t, real=CUDAGraphModel.capture:
                        captured.append(tuple(t["input_ids"].shape)) or real(self, t))
    runs = []
    for model, graphs in ((inf, False), (inf, True), (inf.compile(), True)):
        cfg = SamplingConfig(steps=steps, predictor=predictor, eos_id=EOS, stop_at_eos=False, cuda_graphs=graphs)
        runs.append(generate(model, cfg, num_samples=4, batch_size=2, seed=3, prompt_ids=PROMPT))
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    assert captured, "no forward was captured"
    assert len(set(runs[1][:, len(PROMPT):].flatten().tolist())) > 3, "outputs should not be trivial"


@pytest.mark.gpu
def test_a_second_generate_call_replays_the_first_calls_graphs(monkeypatch):
    """Inside shared_graphs (the throughput benchmark's warm-up and timed calls) a second call
    captures nothing (MDLM: no KV cache renewed per call, which would drop them); outside, each
    call's graphs are its own."""
    from megatron_dllm.sampling.cuda_graphs import shared_graphs

    inf = InferenceModel(random_model("mdlm").double().cuda(), "mdlm", MASK, V, L, None, "hf")
    captured = []
    monkeypatch.setattr(CUDAGraphModel, "capture", lambda self, t, real=CUDAGraphModel.capture:
                        captured.append(tuple(t["input_ids"].shape)) or real(self, t))
    cfg = SamplingConfig(steps=8, eos_id=EOS, cuda_graphs=True)
    with shared_graphs(inf.model):
        first = generate(inf, cfg, num_samples=2, seed=3)
        assert captured, "no forward was captured"
        count = len(captured)
        assert torch.equal(generate(inf, cfg, num_samples=2, seed=3), first) and len(captured) == count
    assert torch.equal(generate(inf, cfg, num_samples=2, seed=3), first) and len(captured) == 2 * count


@pytest.mark.slow
@pytest.mark.parametrize("family,predictor,steps", [("ar", "ancestral", 1), ("esolm", "ancestral", 9)])
def test_a_compiled_model_gives_the_eager_samples_from_a_few_graphs(family, predictor, steps):
    """`InferenceModel.compile()`: the eager samples (float64), and the steps of every sample and
    prompt length share a few graphs (the second cache length or prompt length met compiles a
    dynamic graph, which serves the rest). On CPU through AOTAutograd's graphs (`aot_eager`: what
    TorchInductor is given, run without its code generation, which costs a minute a graph here);
    Inductor's own kernels are checked on a GPU (test_cuda_graph_samples_equal_eager_ones)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    inf = InferenceModel(random_model(family).double(), family, MASK, V, L, None, "hf")
    torch._dynamo.reset()
    counters.clear()
    runs = []
    for model in (inf, inf.compile(backend="aot_eager")):
        cfg = SamplingConfig(steps=steps, predictor=predictor, eos_id=EOS, stop_at_eos=False)
        runs.append([generate(model, cfg, num_samples=2, seed=seed, prompt_ids=prompt)
                     for seed, prompt in enumerate((PROMPT, PROMPT[:2], PROMPT + PROMPT))])
    torch._dynamo.reset()
    for eager, compiled in zip(*runs):
        assert torch.equal(compiled, eager)
    assert 1 <= counters["stats"]["unique_graphs"] <= 4, dict(counters["stats"])  # of 20 to 40 forwards


def after_first_eos(x: torch.Tensor, start: int) -> torch.Tensor:
    """x with every position after each row's first EOS (from `start` on) set to EOS."""
    eos = (x[:, start:] == EOS).int().cumsum(1) > 0
    out = x.clone()
    out[:, start:][eos] = EOS
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("family", ["ar", "esolm"])
def test_eos_stopping_equals_the_full_run_cut_at_eos(family, device):
    """Left-to-right stopping at EOS (on CUDA without waiting for the GPU: `EosStop`) gives the
    full-length run with EOS after each row's first EOS, and stops early (fewer model calls)."""
    model = random_model(family).double().to(device)
    with torch.no_grad():
        model.backbone.output_layer.linear.bias[EOS] += 6.0  # EOS comes within a few tokens
    inf = InferenceModel(model, family, MASK, V, L, None, "hf")
    calls = []
    model.backbone.register_forward_pre_hook(lambda *_: calls.append(1))
    runs = {}
    for stop in (False, True):
        calls.clear()
        cfg = SamplingConfig(predictor="left-to-right", eos_id=EOS, stop_at_eos=stop)
        runs[stop] = (generate(inf, cfg, num_samples=4, seed=1, prompt_ids=PROMPT), len(calls))
    (full, full_calls), (stopped, stopped_calls) = runs[False], runs[True]
    assert torch.equal(stopped, after_first_eos(full, len(PROMPT)))
    every_row_ends = bool((full[:, len(PROMPT):] == EOS).any(1).all())
    assert every_row_ends or device == "cuda"  # the seed makes every row end on CPU; CUDA draws others
    assert stopped_calls < full_calls or not every_row_ends


@pytest.mark.gpu
@pytest.mark.parametrize("family,protocol", [("ar", "left-to-right"), ("mdlm", "left-to-right"),
                                             ("duo", "left-to-right"), ("esolm", "left-to-right"),
                                             ("esolm", "native"), ("mdlm", "native")])
def test_gsm8k_with_cuda_graphs_gives_the_same_answers(family, protocol, tmp_path):
    """GSM8K at batch 1 (the paper's throughput protocol) with --cuda-graphs: every generation equal."""
    from test_gsm8k import DigitTokenizer

    from megatron_dllm.evaluation import gsm8k

    inf = InferenceModel(random_model(family, length=48).double().cuda(), family, MASK, V, 48, DigitTokenizer(), "hf")
    problems = [gsm8k.Problem(i, q, str(i), f"#### {i}") for i, q in enumerate(["1?", "12 + 30?", "100 - 1 is?"])]
    runs = []
    for graphs in (False, True):
        out = tmp_path / f"pred-{graphs}.jsonl"
        gsm8k.evaluate_gsm8k(inf, problems, protocol, max_new_tokens=8, steps=4, predictions=str(out),
                             cuda_graphs=graphs)
        runs.append(out.read_text())
    assert runs[0] == runs[1]
