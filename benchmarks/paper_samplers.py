"""The paper's own samplers, from a checkout of its public code given at run time (never copied
here), driven on its own DiT for `bench_gpu_generation.py`.

Its sampling loops are methods of its Lightning modules (`algo.py`), so the modules are built
with their real constructors, from the checkout's own `configs/config.yaml` and
`configs/algo/*.yaml`, with the model shape, length, steps and sampler filled in as its
`scripts/*/gen_ppl.sh` set them:

  ar     `AR.generate_samples`, `sampling.kv_cache=True` (one call per token, KV cache)
  mdlm   `Diffusion.generate_samples`, predictor `ancestral_cache` (the model is reused while
         a step changes nothing), noise removal `ancestral`
  duo    `Diffusion.generate_samples` of `DUO_BASE`, predictor `ancestral`, noise removal `ancestral`
  esolm  `EsoLM.generate_samples`, `alpha_0 = 1`, predictor `ancestral`, `sampling.kv_cache=True`

Float64 sampling (`sampling.use_float64`, its default), nucleus 1.0. The weights stay float32, as
Lightning keeps them; its DiT runs its blocks under its own bf16 autocast, attention through its
compiled FlexAttention (AR and Eso-LM with their KV caches use its plain matmul attention).
Its default initialisation is kept (random weights change no count of model calls). Its AR and
Eso-LM samplers draw their Gumbel noise for the whole sample up front, on the host ([batch, L, V]
float32, moved to the device), which costs host time and device memory at large batches; that is
part of its samplers and counted in their time.

What is scaffolding rather than the paper's code: a stand-in tokenizer (its constructor reads only
the vocabulary size, a missing mask token and, for AR, the BOS id); a stand-in for its `Metrics`
(Gen PPL and loss metrics, whose constructor downloads the judge's tokenizer from the model hub;
sampling never touches them); the `hydra` and `timm` modules, when not installed, are replaced
by empty stand-ins, as only training touches them (the optimizer's scheduler). `lightning`,
`torchmetrics`, `omegaconf`, `einops`, `transformers`, `fsspec` and `huggingface_hub` must be
installed. Importing its `models/dit.py` turns on TF32 matmuls and `cudnn.benchmark`
process-wide, so this project's samplers run with them too.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import types

import torch

from megatron_dllm.errors import InputError
from megatron_dllm.model.constants import COND_DIM

MODULES = ("algo", "trainer_base", "utils", "metrics", "models", "dataloader")
CLASSES = {"ar": "AR", "mdlm": "MDLM", "duo": "DUO_BASE", "esolm": "EsoLM"}
ALGO_CONFIGS = {"ar": "ar", "mdlm": "mdlm", "duo": "duo_base", "esolm": "esolm"}
SAMPLING = {"ar": {"predictor": "ancestral", "kv_cache": True},
            "mdlm": {"predictor": "ancestral_cache", "kv_cache": False},
            "duo": {"predictor": "ancestral", "kv_cache": False},
            "esolm": {"predictor": "ancestral", "kv_cache": True}}
STAND_INS = {"hydra": ("utils",), "timm": ("scheduler",)}  # packages only its training reaches


class Tokenizer:
    """What the paper's constructor and AR sampler read of a tokenizer: `len` (the vocabulary
    without [MASK], which it appends), no mask token, and a BOS id."""

    mask_token = None

    def __init__(self, vocab_size: int, bos_id: int):
        self.vocab_size, self.bos_token_id = vocab_size, bos_id

    def __len__(self) -> int:
        return self.vocab_size - 1


class NoMetrics:
    """In place of the paper's `metrics.Metrics`, which sampling never uses."""

    def __init__(self, **_):
        pass

    def to(self, *_, **__):
        return self


def _stand_in(package: str, submodules) -> None:
    """An empty `package` (and submodules) in sys.modules; `timm.scheduler.CosineLRScheduler`,
    a base class of a scheduler its utils module defines, is a plain class."""
    root = types.ModuleType(package)
    sys.modules[package] = root
    for name in submodules:
        module = types.ModuleType(f"{package}.{name}")
        setattr(root, name, module)
        sys.modules[module.__name__] = module
    if package == "timm":
        sys.modules["timm.scheduler"].CosineLRScheduler = type("CosineLRScheduler", (), {})


def load_paper_algo(path: str):
    """The paper code's `algo` module, imported from the checkout at `path`."""
    if not os.path.isfile(os.path.join(path, "algo.py")) or not os.path.isdir(os.path.join(path, "configs", "algo")):
        raise InputError(f"--paper-code {path}: expected a checkout of the paper's code (algo.py, configs/algo/)")
    if "algo" in sys.modules:
        return sys.modules["algo"]
    clashes = [m for m in MODULES if m in sys.modules]
    if clashes:
        raise InputError(f"--paper-code {path}: its top-level modules {clashes} clash with modules already imported")
    for package, submodules in STAND_INS.items():
        if importlib.util.find_spec(package) is None:
            _stand_in(package, submodules)
    sys.path.insert(0, os.path.abspath(path))
    try:
        import algo
    except ModuleNotFoundError as err:
        raise InputError(f"--paper-code {path}: its code needs the package {err.name!r}, which is not installed "
                         f"(docs/gpu.md lists what to carry)") from None
    finally:
        sys.path.remove(os.path.abspath(path))
    algo.trainer_base.metrics.Metrics = NoMetrics
    return algo


def build_config(path: str, family: str, preset, length: int, steps: int):
    """The paper's config for one sampler: its configs/config.yaml sections with its algo config,
    noise and prior, the model shape, and the sampling fields its gen_ppl scripts set."""
    from omegaconf import OmegaConf

    base = OmegaConf.load(os.path.join(path, "configs", "config.yaml"))
    for key in ("defaults", "hydra", "trainer", "loader", "wandb", "checkpointing"):  # resolved only at its launch
        base.pop(key, None)
    base.algo = OmegaConf.load(os.path.join(path, "configs", "algo", f"{ALGO_CONFIGS[family]}.yaml"))
    base.noise = OmegaConf.load(os.path.join(path, "configs", "noise", "log-linear.yaml"))
    base.prior = OmegaConf.load(os.path.join(path, "configs", "prior", "none.yaml"))
    base.model = {"name": "bench", "length": length, "hidden_size": preset.hidden_size, "cond_dim": COND_DIM,
                  "n_blocks": preset.num_layers, "n_heads": preset.num_attention_heads, "dropout": 0.0,
                  "scale_by_sigma": True}
    base.sampling.steps = steps
    base.sampling.update(SAMPLING[family])
    if family == "esolm":
        base.algo.alpha_0 = 1.0
    return base


class PaperSampler:
    """One of the paper's samplers on its own DiT: `sample(batch)` -> ids [batch, L] on the device;
    `calls` counts model calls (forward passes through its first block)."""

    def __init__(self, path: str, family: str, preset, vocab: int, length: int, steps: int, device, bos_id: int):
        algo = load_paper_algo(path)
        self.family, self.steps, self.calls = family, steps, 0
        self.length, self.vocab = length, vocab
        config = build_config(path, family, preset, length, steps)
        with torch.device(device):  # weights made on the device: a 1.7B float32 init on the host takes long
            self.module = getattr(algo, CLASSES[family])(config, Tokenizer(vocab, bos_id))
        self.module = self.module.to(device)
        self.module.backbone.eval()
        self.module.backbone.blocks[0].register_forward_pre_hook(self._count)

    def _count(self, *_):
        self.calls += 1

    def host_batch_limit(self) -> int | None:
        """The largest power-of-two batch whose up-front Gumbel noise (AR and Eso-LM: [batch, L, V]
        float32 on the host) takes at most half the host memory available now: beyond it the OS
        would kill the process rather than raise. None: the sampler draws no such noise."""
        if self.family not in ("ar", "esolm"):
            return None
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        fits = available // 2 // (self.length * self.vocab * 4)
        return 1 << max(0, int(fits).bit_length() - 1)

    def sample(self, batch: int) -> torch.Tensor:
        return self.module.generate_samples(num_samples=batch, num_steps=self.steps)

    def generated(self, out: torch.Tensor) -> int:
        """Generated tokens in `out`: every position but AR's BOS."""
        return out.shape[0] * (out.shape[1] - (self.family == "ar"))
