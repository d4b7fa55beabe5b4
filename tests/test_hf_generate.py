"""`generate` / `diffusion_generate` of HF exports (sampling/hf_generation.py, hf/remote_code.py):
an export of every diffusion family (BD3-LM included), loaded with transformers' AutoModelForMaskedLM
(trust_remote_code, offline) in a process where megatron_dllm cannot be imported, samples exactly
what megatron_dllm's own samplers give on the same weights and seed (float64, CPU): unconditional,
one prompt, prompts of different lengths (padding), a given generator, Eso-LM's block sampler, MDLM
and Duo's remasking samplers with their knobs. The AR export keeps transformers' generate. The
shipped files are the ones transformers copies, import nothing but torch, transformers and the
standard library, and bad arguments are ValueErrors."""
import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from megatron_dllm.checkpoint.identity import ModelIdentity
from megatron_dllm.hf import export
from megatron_dllm.hf.random_model import random_dense_model
from megatron_dllm.hf.remote_code import remote_code_files

V, MASK, EOS, L = 33, 32, 0, 24
DIFFUSION = ["mdlm", "duo", "esolm", "bd3lm", "mdlm-shift"]
# family_options of the exports: BD3-LM's blocks; "mdlm-shift" is an MDLM trained with --shift
OPTIONS = {"bd3lm": {"block_size": 4, "noise": "mask"}, "mdlm-shift": {"shift": True}}
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13]]  # padded on the left to 5 in the padded case
# (name, generate's arguments): JSON, so the worker process reads them
CASES = [("unconditional", {"num_return_sequences": 2, "max_new_tokens": 12, "steps": 4, "seed": 3}),
         ("prompt", {"input_ids": [PROMPTS[1], PROMPTS[1][::-1]], "max_new_tokens": 8, "steps": 5, "seed": 1}),
         ("padded", {"input_ids": [[EOS, EOS] + PROMPTS[0], PROMPTS[1]], "attention_mask": [[0, 0, 1, 1, 1], [1] * 5],
                     "max_new_tokens": 6, "steps": 3, "seed": 2, "eos_token_id": EOS}),
         ("generator", {"num_return_sequences": 2, "max_new_tokens": 10, "steps": 4, "generator": 7}),
         ("left-to-right", {"input_ids": [PROMPTS[0]], "max_new_tokens": 6, "sampler": "left-to-right", "seed": 4})]
BLOCK = ("block", {"num_return_sequences": 2, "max_new_tokens": 12, "steps": 4, "sampler": "block", "seed": 5})
# MDLM and Duo's remasking predictors, with their knobs: blocks unconditionally, threshold on padded prompts
REMASKING = [("low-confidence", {"num_return_sequences": 2, "max_new_tokens": 10, "steps": 4,
                                 "sampler": "low-confidence", "block_length": 4, "seed": 6}),
             ("threshold", {"input_ids": [[EOS, EOS] + PROMPTS[0], PROMPTS[1]],
                            "attention_mask": [[0, 0, 1, 1, 1], [1] * 5], "max_new_tokens": 6, "sampler": "threshold",
                            "threshold": 0.05, "seed": 7, "eos_token_id": EOS}),
             ("noise-removal", {"input_ids": [PROMPTS[1]], "max_new_tokens": 8, "steps": 3,
                                "noise_removal": "ancestral", "seed": 8})]
KNOBS = {"block_length": "block_length", "tokens_per_step": "tokens_per_step", "threshold": "confidence_threshold",
         "entropy_bound": "entropy_bound", "noise_removal": "noise_removal"}  # generate's argument -> SamplingConfig's


def write_export(name: str, out) -> str:
    """A randomly initialised export of the family `name` (`OPTIONS`), written as
    tools/convert_to_hf.py writes one."""
    family, options = name.split("-")[0], OPTIONS.get(name, {})
    identity = ModelIdentity(family, 32, 2, 2, V, MASK, family_options=options)
    attention = {"ar": "causal", "esolm": "causal", "bd3lm": "block_diffusion"}.get(family, "bidirectional")
    config = export.hf_config_dict(identity, attention, L)
    config["cond_dim"] = 16  # random_dense_model's
    model = random_dense_model(family, V, L, seed=len(name), family_options=options or None)
    export.write_hf_dir(str(out), model.state_dict(), config)
    return str(out)


def cases(name):
    return CASES + {"esolm": [BLOCK], "bd3lm": []}.get(name, REMASKING)


def expected(inf, case: dict) -> torch.Tensor:
    """megatron_dllm's own samples for generate's arguments `case`."""
    from megatron_dllm.sampling import SamplingConfig, generate
    from megatron_dllm.sampling.conditional import generate_native_batch

    new, steps = case["max_new_tokens"], case.get("steps", 128)
    knobs = {field: case[arg] for arg, field in KNOBS.items() if arg in case}
    predictor = case.get("sampler", "ancestral")
    if "attention_mask" in case:
        prompts = [[t for t, keep in zip(row, mask) if keep] for row, mask in zip(case["input_ids"],
                                                                                 case["attention_mask"])]
        answers = generate_native_batch(inf, prompts, new, EOS, steps=steps, seeds=case["seed"], predictor=predictor,
                                        **knobs)
        width = len(case["input_ids"][0]) + max(map(len, answers))
        return torch.tensor([row + answer + [EOS] * (width - len(row) - len(answer))
                             for row, answer in zip(case["input_ids"], answers)])
    prompt = case.get("input_ids")
    cfg = SamplingConfig(steps=steps, seq_length=len(prompt[0]) + new if prompt else new,
                         predictor=predictor, **knobs)
    rows = len(prompt) if prompt else case["num_return_sequences"]
    generator = torch.Generator().manual_seed(case["generator"]) if "generator" in case else None
    return generate(inf, cfg, num_samples=rows, seed=case.get("seed", 0), prompt_ids=prompt, generator=generator)


WORKER = r"""
import json, os, sys
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != REPO]


class NoMegatron:  # megatron_dllm (and megatron) are not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("megatron_dllm", "megatron"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, NoMegatron())
import torch
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

out = {}
for family, path, cases in json.loads(sys.argv[1]):
    if family == "ar":
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float64)
        ids = torch.tensor([[5, 6, 7, 8]])
        out["ar"] = {"generate": model.generate(ids, max_new_tokens=4, do_sample=False).tolist(),
                     "logits": model(input_ids=ids).logits[0, -1].tolist(), "class": type(model).__module__}
        continue
    model = AutoModelForMaskedLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float64)
    got = {"class": type(model).__module__}
    for name, case in cases:
        case = dict(case)
        if "generator" in case:
            case["generator"] = torch.Generator().manual_seed(case["generator"])
        call = model.diffusion_generate if name == "prompt" else model.generate
        got[name] = call(**{k: torch.tensor(v) if k in ("input_ids", "attention_mask") else v
                            for k, v in case.items()}).tolist()
    out[family] = got
out["imported"] = sorted({m.split(".")[0] for m in sys.modules} & {"megatron_dllm", "megatron"})
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_export_generate_equals_the_project_samplers_without_megatron_dllm(tmp_path):
    from megatron_dllm.sampling.loading import load_inference_model

    paths = {family: write_export(family, tmp_path / family) for family in ["ar", *DIFFUSION]}
    jobs = [(family, paths[family], cases(family) if family != "ar" else []) for family in paths]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "HF_MODULES_CACHE": str(tmp_path / "modules"), "PYTHONPATH": "", "PYTHONWARNINGS": "ignore"}
    repo = os.path.dirname(os.path.dirname(os.path.abspath(export.__file__)))
    proc = subprocess.run([sys.executable, "-c", f"REPO = {repo!r}\n" + WORKER, json.dumps(jobs)], env=env,
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    got = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert got["imported"] == []
    for family in DIFFUSION:
        assert got[family]["class"].startswith("transformers_modules.")  # the export's code ran
        inf = load_inference_model(paths[family], dtype=torch.float64)  # megatron_dllm's, on the same weights
        for name, case in cases(family):
            want = expected(inf, case)
            assert torch.equal(torch.tensor(got[family][name]), want), (family, name, got[family][name], want)
            if name == "unconditional":
                assert bool((want != MASK).all())
    # AR: transformers' own generate, greedy = the argmax of the model's next-token logits
    ar = got["ar"]
    assert len(ar["generate"][0]) == 8 and ar["generate"][0][4] == max(range(V), key=ar["logits"].__getitem__)
    # transformers copied exactly the files the export ships
    copied = {name for _, _, names in os.walk(tmp_path / "modules") for name in names if name.endswith(".py")}
    assert copied - {"__init__.py"} == set(remote_code_files())


def test_the_package_classes_generate_the_same_way(tmp_path):
    """Loaded with megatron_dllm's own classes (as the tools load an export), `generate` runs
    megatron_dllm/sampling and gives the same samples."""
    from megatron_dllm.hf.load_export import load_model
    from megatron_dllm.sampling.loading import load_inference_model

    path = write_export("mdlm", tmp_path / "mdlm")
    model = load_model(path).double()
    inf = load_inference_model(path, dtype=torch.float64)
    for name, case in CASES[:3] + REMASKING:
        given = {k: torch.tensor(v) if k in ("input_ids", "attention_mask") else v for k, v in case.items()}
        assert torch.equal(model.generate(**given), expected(inf, case)), name


def test_a_shifted_export_generates_from_the_logits_at_i_minus_1(tmp_path):
    """An MDLM trained with --shift exports its shift (config.json's family_options) and its
    `generate` applies it, as the native samplers do: each case equals megatron_dllm's samplers on
    the export, and none equals sampling the same weights unshifted."""
    from megatron_dllm.hf.load_export import load_model
    from megatron_dllm.sampling.loading import load_inference_model

    path = write_export("mdlm-shift", tmp_path / "mdlm")
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["family_options"] == {"shift": True}
    model = load_model(path).double()
    inf = load_inference_model(path, dtype=torch.float64)
    assert inf.make_family().shift
    unshifted = dataclasses.replace(inf, family_options={})
    for name, case in CASES[:3] + REMASKING:
        given = {k: torch.tensor(v) if k in ("input_ids", "attention_mask") else v for k, v in case.items()}
        got = model.generate(**given)
        assert torch.equal(got, expected(inf, case)), name
        assert not torch.equal(got, expected(unshifted, case)), name


@pytest.mark.parametrize("kwargs,message", [
    ({"sampler": "block"}, "sampler='block' is not available for the mdlm family; valid: ancestral, left-to-right, "
                           "low-confidence, threshold, entropy-bound"),
    ({"sampler": "low-confidence", "threshold": 0.5},
     "threshold applies to sampler=threshold only, not sampler=low-confidence"),
    ({"sampler": "left-to-right", "block_length": 4},
     "block_length applies to sampler=ancestral|low-confidence|threshold|entropy-bound only, not "
     "sampler=left-to-right"),
    ({"sampler": "threshold", "threshold": 1.5}, "threshold=1.5: must be in [0, 1]"),
    ({"top_p": 1.5}, "top_p=1.5: must be in (0, 1]"),
    ({"temperature": 0.0}, "temperature=0.0: must be a finite number >= 1e-30"),
    ({"sampler": "left-to-right", "noise_removal": "ancestral"},
     "noise_removal='ancestral': 'greedy', or 'ancestral' with sampler='ancestral'"),
    ({"temperature": float("nan")}, "temperature=nan: must be a finite number >= 1e-30"),
    ({"sampler": "low-confidence", "block_length": 0}, "block_length=0: must be an integer >= 1"),
    ({"sampler": "low-confidence", "tokens_per_step": 2.5}, "tokens_per_step=2.5: must be an integer >= 1"),
    ({"sampler": "entropy-bound", "entropy_bound": -1.0}, "entropy_bound=-1.0: must be a finite number >= 0"),
    ({"sampler": "remask"}, "sampler='remask' is not available"),
    ({"steps": 0}, "steps=0: must be an integer >= 1"),
    ({"max_new_tokens": 0}, "max_new_tokens=0: must be an integer >= 1"),
    ({"input_ids": [[1, 2]], "max_new_tokens": L}, "do not fit the model's context of 24"),
    ({"input_ids": [[1, 2]], "attention_mask": [[0, 1]]}, "give eos_token_id"),
    ({"input_ids": [[1, 2]], "attention_mask": [[0, 1]], "eos_token_id": EOS, "float64": False},
     "float64=False: prompts given with an attention_mask are answered with conditional generation's own"),
    ({"input_ids": [[1, 2]], "attention_mask": [[1, 1]], "eos_token_id": EOS, "stop_at_eos": False},
     "stop_at_eos=False: prompts given with an attention_mask are answered"),
    ({"input_ids": [[1, 2]], "attention_mask": [[0, 1]], "eos_token_id": [EOS, 3]},
     f"eos_token_id=[{EOS}, 3]: expected one token id"),
    ({"input_ids": [[1, 2], [3, 4]], "attention_mask": [[1, 1], [0, 0]], "eos_token_id": EOS},
     "attention_mask: row 1 marks no token; each prompt needs at least one"),
    ({"input_ids": [[1, 2]], "attention_mask": [[0, 1]], "eos_token_id": EOS, "max_new_tokens": L},
     "a prompt of 1 tokens and max_new_tokens=24 do not fit the model's context of 24"),
])
def test_bad_arguments_are_clear_value_errors(tmp_path, kwargs, message):
    from megatron_dllm.hf.load_export import load_model

    model = load_model(write_export("mdlm", tmp_path / "mdlm"))
    kwargs = {k: torch.tensor(v) if k in ("input_ids", "attention_mask") else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=re.escape(message)):
        model.generate(steps=kwargs.pop("steps", 2), **kwargs)


def test_padded_prompts_give_each_of_several_samples_its_own_seed(tmp_path):
    """With padding and num_return_sequences=n, a prompt's j-th sample is that prompt's answer for
    seed + j: as many different samples as asked, each what batch 1 gives for its seed."""
    from megatron_dllm.hf.load_export import load_model
    from megatron_dllm.sampling.conditional import generate_native
    from megatron_dllm.sampling.loading import load_inference_model

    path = write_export("mdlm", tmp_path / "mdlm")
    model, inf = load_model(path).double(), load_inference_model(path, dtype=torch.float64)
    ids, mask = torch.tensor([[EOS, EOS] + PROMPTS[0], PROMPTS[1]]), torch.tensor([[0, 0, 1, 1, 1], [1] * 5])
    out = model.generate(ids, attention_mask=mask, num_return_sequences=3, max_new_tokens=6, steps=3, seed=4,
                         eos_token_id=EOS)
    for row, (prompt, j) in zip(out, [(p, j) for p in PROMPTS for j in range(3)]):
        answer = generate_native(inf, prompt, 6, EOS, steps=3, seed=4 + j)
        assert row[5:5 + len(answer)].tolist() == answer
    assert len({tuple(row.tolist()) for row in out[3:]}) == 3  # three samples of the second prompt
    # a prompt's answer does not depend on whether another prompt of the batch holds padding
    alone = model.generate(ids[1:], attention_mask=mask[1:], max_new_tokens=6, steps=3, seed=4, eos_token_id=EOS)
    expected = generate_native(inf, PROMPTS[1], 6, EOS, steps=3, seed=4)
    assert alone[0, 5:5 + len(expected)].tolist() == expected
    # the EOS as transformers' configs may hold it: a one-element list or tensor, a numpy integer
    import numpy as np

    for eos in ([EOS], torch.tensor([EOS]), np.int64(EOS)):
        assert torch.equal(model.generate(ids[1:], attention_mask=mask[1:], max_new_tokens=6, steps=3, seed=4,
                                          eos_token_id=eos), alone)


def test_a_padded_bd3lm_forward_keeps_its_block_causal_attention(tmp_path):
    """A padding mask is combined with the family's layout: BD3-LM's block i never sees block i+1,
    and the real tokens' logits do not change with the padding beside them."""
    from megatron_dllm.hf.load_export import load_model

    model = load_model(write_export("bd3lm", tmp_path / "bd3lm")).double()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    later = ids.clone()
    later[0, 6] = 13  # in the second block (block size 4)
    padded = torch.tensor([[1] * 7 + [0]])
    with torch.no_grad():
        unpadded = model(ids[:, :7]).logits  # the real tokens alone
        a, b = model(ids, attention_mask=padded).logits, model(later, attention_mask=padded).logits
    assert torch.equal(a[0, :4], b[0, :4]) and not torch.equal(a[0, 4:7], b[0, 4:7])
    assert torch.allclose(a[0, :7], unpadded[0], atol=1e-12)
    # left padding (the exported SentencePiece tokenizer's side): the blocks start at the first real token
    left = torch.cat([torch.tensor([[1, 1, 1]]), ids[:, :7]], 1)
    with torch.no_grad():
        shifted = model(left, attention_mask=torch.tensor([[0] * 3 + [1] * 7])).logits
    assert torch.allclose(shifted[0, 3:], unpadded[0], atol=1e-12)


@pytest.mark.parametrize("family", ["mdlm", "ar"])
def test_resize_token_embeddings_resizes_the_logits_too(tmp_path, family):
    """transformers' resize_token_embeddings (new tokens for fine-tuning) reaches the output layer:
    the logits gain the new columns, and the old ones are unchanged."""
    from megatron_dllm.hf.load_export import load_model

    model = load_model(write_export(family, tmp_path / family)).double().eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        before = model(ids).logits
        model.resize_token_embeddings(V + 3, mean_resizing=False)
        after = model(ids).logits
    assert after.shape[-1] == model.config.vocab_size == V + 3
    # float64 rounding only: a wider output projection may take another GEMM kernel (4e-16 seen)
    torch.testing.assert_close(after[..., :V], before, rtol=0, atol=1e-12)


def test_the_forward_refuses_what_it_cannot_do(tmp_path):
    from megatron_dllm.hf.load_export import load_model

    model = load_model(write_export("mdlm", tmp_path / "mdlm"))
    for call, message in [(lambda: model(torch.tensor([1, 2, 3])),
                           "input_ids: expected [batch, length], got shape (3,)"),
                          (lambda: model(torch.ones(1, L + 1, dtype=torch.long)),
                           f"input_ids: {L + 1} tokens exceed the model's context of {L}"),
                          (lambda: model(torch.ones(1, 4, dtype=torch.long), output_hidden_states=True),
                           "output_hidden_states / output_attentions: this model returns logits only")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            call()
    ar = load_model(write_export("ar", tmp_path / "ar"))  # transformers' generate: refused there too, not None
    with pytest.raises(ValueError, match=re.escape("output_hidden_states / output_attentions: this model returns")):
        ar.generate(torch.tensor([[1, 2]]), max_new_tokens=2, return_dict_in_generate=True, output_hidden_states=True)


def test_the_samplers_errors_name_generates_arguments_not_the_flags(tmp_path):
    from megatron_dllm.hf.load_export import load_model

    model = load_model(write_export("esolm", tmp_path / "esolm"))
    for kwargs, message in [({"sampler": "block", "steps": 5, "max_new_tokens": 12},
                             "sampler block needs steps to divide the sequence length 12 (so steps <= 12); got "
                             "steps 5"),
                            ({"input_ids": torch.tensor([[V + 7, 1]]), "max_new_tokens": 4, "steps": 2},
                             f"input_ids: ids must be in [0, {V}) and not [MASK] ({MASK})"),
                            ({"input_ids": torch.tensor([[3, MASK]]), "max_new_tokens": 4, "steps": 2},
                             f"input_ids: ids must be in [0, {V}) and not [MASK] ({MASK})")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            model.generate(**kwargs)


def test_a_schedule_the_samplers_do_not_use_is_refused(tmp_path):
    from megatron_dllm.hf.load_export import load_model

    model = load_model(write_export("duo", tmp_path / "duo"))
    model.config.noise_eps = 1e-2
    with pytest.raises(ValueError, match=re.escape("noise_eps 0.01; the samplers' schedule is 'loglinear' with eps")):
        model.generate(max_new_tokens=4, steps=2)


def test_shipped_files_import_only_torch_transformers_and_the_standard_library():
    """What transformers checks (`check_imports`) before it runs remote code from the Hub: every
    shipped file's absolute imports (outside try blocks) are installed where the export is used."""
    from transformers.dynamic_module_utils import get_imports

    allowed = set(sys.stdlib_module_names) | {"torch", "transformers"}
    for name, source in remote_code_files().items():
        assert set(get_imports(source)) <= allowed, (name, get_imports(source))
    shipped = set(remote_code_files())
    assert {"modeling_dllm.py", "hf_generation.py", "mdlm.py", "duo.py", "esolm.py", "categorical.py",
            "deps.py"} <= shipped
    assert "loading.py" not in shipped  # megatron checkpoints: megatron_dllm only


def test_export_schedule_is_the_families_schedule():
    """The export's deps.py gives the samplers what megatron_dllm's families give them."""
    import importlib.util
    import types

    from megatron_dllm.families import get_family

    # load hf/sampling_deps.py as an export's deps.py, its siblings megatron_dllm's own files
    pkg = types.ModuleType("export_pkg")
    pkg.__path__ = []
    sys.modules["export_pkg"] = pkg
    try:
        for module in ("configuration_dllm", "modeling_dllm", "errors", "seeding", "constants", "schedules", "shift",
                       "uniform", "deps"):
            from megatron_dllm.hf.remote_code import source_path

            spec = importlib.util.spec_from_file_location(f"export_pkg.{module}", source_path(module))
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod
            spec.loader.exec_module(mod)
        deps = sys.modules["export_pkg.deps"]
        t = torch.linspace(0, 1, 11, dtype=torch.float64)
        for name in DIFFUSION:
            family, options = name.split("-")[0], OPTIONS.get(name, {})
            ours, theirs = get_family(family, MASK, V, **options), deps.get_family(family, MASK, V, **options)
            assert torch.equal(ours.schedule.alpha(t), theirs.schedule.alpha(t)), name
            assert ours.shift == theirs.shift == (name == "mdlm-shift")
        assert deps.get_family("duo", MASK, V).num_real == get_family("duo", MASK, V).num_real == V - 1
        for noise in ("mask", "uniform"):  # what BD3-LM's sampler reads: blocks, noise, the in-block family
            ours, theirs = (f("bd3lm", MASK, V, block_size=4, noise=noise) for f in (get_family, deps.get_family))
            assert (theirs.block_size, theirs.noise) == (ours.block_size, ours.noise)
            assert torch.equal(ours.inner.schedule.alpha(t), theirs.inner.schedule.alpha(t))
            assert theirs.inner.num_real == getattr(ours.inner, "num_real", V - 1)
    finally:
        for name in [m for m in sys.modules if m == "export_pkg" or m.startswith("export_pkg.")]:
            del sys.modules[name]


def test_a_mask_without_padding_takes_every_sampler_and_an_empty_prompt_is_unconditional(tmp_path):
    """Eso-LM's block sampler answers prompts given with an attention_mask as generate_native does;
    `**tok("")` (an empty prompt and mask) samples unconditionally, as without the mask."""
    from megatron_dllm.hf.load_export import load_model
    from megatron_dllm.sampling.conditional import generate_native
    from megatron_dllm.sampling.loading import load_inference_model

    path = write_export("esolm", tmp_path / "esolm")
    model, inf = load_model(path).double(), load_inference_model(path, dtype=torch.float64)
    prompt = [5, 6, 7, 8]
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 4), max_new_tokens=8, steps=4,
                         sampler="block", seed=2, eos_token_id=EOS)
    expected = generate_native(inf, prompt, 8, EOS, steps=4, seed=2, predictor="block")
    assert out[0, 4:4 + len(expected)].tolist() == expected
    empty = torch.zeros(1, 0, dtype=torch.long)
    assert torch.equal(model.generate(empty, attention_mask=empty, max_new_tokens=6, steps=3, seed=1),
                       model.generate(empty, max_new_tokens=6, steps=3, seed=1))


def test_an_export_missing_weights_or_damaged_is_refused_not_filled_at_random(tmp_path):
    """transformers fills a weight missing from model.safetensors with random values and only warns;
    the tools' loader refuses it, an extra one, and an unreadable file, naming the directory."""
    from safetensors.torch import load_file, save_file

    from megatron_dllm.errors import InputError
    from megatron_dllm.hf.load_export import load_model
    from megatron_dllm.hf.random_model import random_dense_model

    export = tmp_path / "hf"
    random_dense_model("mdlm", 64, 16).save_pretrained(str(export))
    weights = export / "model.safetensors"
    intact = load_file(str(weights))
    assert load_model(str(export)) is not None
    missing = "backbone.vocab_embed.weight"
    save_file({k: v for k, v in intact.items() if k != missing}, str(weights))
    with pytest.raises(InputError, match=rf"^{export}: the weights do not match the mdlm model of config.json "
                                         rf"\(missing: {missing}\)$"):
        load_model(str(export))
    save_file({**intact, "junk.weight": intact[missing].clone()}, str(weights))
    with pytest.raises(InputError, match=r"\(not of this model: junk.weight\)$"):
        load_model(str(export))
    config = json.loads((export / "config.json").read_text())  # weights beside another model's config
    (export / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 8}))
    save_file(intact, str(weights))
    with pytest.raises(InputError, match=r"\(other shapes: .*backbone.vocab_embed.weight"):
        load_model(str(export))
    (export / "config.json").write_text(json.dumps(config))
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(InputError, match=rf"^{export}: unreadable safetensors weights"):
        load_model(str(export))
