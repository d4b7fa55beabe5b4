"""Conditional generation (megatron_dllm/sampling/conditional.py) for every family and protocol:
the prompt is never altered in any model call, generation stops at EOS (EOS included, nothing
after it) or after max_new_tokens, and greedy left-to-right equals a plain argmax loop."""
import pytest
import torch
from test_sampling import MASK, V, random_model

from megatron_dllm.sampling import InferenceModel
from megatron_dllm.sampling.conditional import generate_left_to_right, generate_native

L, EOS = 24, 0
FAMILIES = ["ar", "mdlm", "duo", "esolm"]
PROMPT = [5, 6, 7, 8, 9]


def model(family, eos_bias=0.0):
    m = random_model(family, length=L)
    with torch.no_grad():
        m.backbone.output_layer.linear.bias[EOS] += eos_bias
    return InferenceModel(m, family, MASK, V, L, None, "hf")


def watch(inf):
    """Record (input_ids, position_ids) of every backbone call."""
    calls = []

    def hook(module, args, kwargs):
        ids = args[0]
        pos = args[1] if len(args) > 1 and args[1] is not None else None
        calls.append((ids.clone(), None if pos is None else pos.clone()))

    return calls, inf.model.backbone.register_forward_pre_hook(hook, with_kwargs=True)


def prompt_seen_intact(calls, kv_cached: bool) -> bool:
    for i, (ids, pos) in enumerate(calls):
        if kv_cached and i > 0 and pos is None:  # AR's later calls feed only the new token
            continue
        pos = torch.arange(ids.shape[1]).expand_as(ids) if pos is None else pos
        at_prompt = pos < len(PROMPT)
        expected = torch.tensor(PROMPT)[pos.clamp(max=len(PROMPT) - 1)]
        if not torch.equal(ids[at_prompt], expected[at_prompt]):
            return False
    return True


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("protocol", ["left-to-right", "native"])
def test_prompt_is_never_altered_and_eos_ends_the_response(family, protocol):
    run = generate_left_to_right if protocol == "left-to-right" else generate_native
    kwargs = {} if protocol == "left-to-right" else {"steps": 4}
    inf = model(family, eos_bias=-1e4)  # never EOS: runs to max_new_tokens
    calls, handle = watch(inf)
    out = run(inf, PROMPT, max_new_tokens=7, eos_id=EOS, greedy=False, seed=3, **kwargs)
    handle.remove()
    assert len(out) == 7 and EOS not in out and MASK not in out and all(0 <= i < V for i in out)
    assert calls and prompt_seen_intact(calls, kv_cached=family in ("ar", "esolm"))
    if protocol == "left-to-right":
        assert len(calls) == 7  # one model call per generated token

    inf = model(family, eos_bias=1e4)  # always EOS: the response is that EOS alone
    calls, handle = watch(inf)
    out = run(inf, PROMPT, eos_id=EOS, greedy=True, **kwargs)
    handle.remove()
    assert out == [EOS]
    if protocol == "left-to-right":
        assert len(calls) == 1


def test_response_is_cut_after_the_first_eos():
    inf = model("mdlm")
    plain = generate_left_to_right(inf, PROMPT, eos_id=EOS, greedy=True)
    assert plain.count(EOS) <= 1 and (EOS not in plain or plain[-1] == EOS)
    assert len(plain) <= L - len(PROMPT)


@pytest.mark.parametrize("family", ["ar", "mdlm"])
def test_greedy_left_to_right_equals_an_argmax_loop(family):
    inf = model(family)
    got = generate_left_to_right(inf, PROMPT, max_new_tokens=8, eos_id=EOS)
    x = list(PROMPT)
    with torch.no_grad():
        for _ in range(8):
            if family == "ar":
                logits = inf.model(input_ids=torch.tensor([x])).logits[0, -1]
            else:  # the prompt and tokens so far, then [MASK] up to the canvas (prompt + 8)
                canvas = x + [MASK] * (len(PROMPT) + 8 - len(x))
                logits = inf.model(input_ids=torch.tensor([canvas])).logits[0, len(x)]
            logits[MASK] = float("-inf")
            x.append(int(logits.argmax()))
            if x[-1] == EOS:
                break
    assert got == x[len(PROMPT):]


def test_bad_prompts_are_named():
    inf = model("ar")
    with pytest.raises(ValueError, match="leaves no room"):
        generate_left_to_right(inf, [1] * L, eos_id=EOS)
    with pytest.raises(ValueError, match="not \\[MASK\\]"):
        generate_left_to_right(inf, [MASK], eos_id=EOS)
