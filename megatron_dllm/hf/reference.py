"""Checkpoints of the paper's code (its models/dit.py `DiT`) as this project's dense DiT.

Two containers hold the same parameter names:
- a PyTorch Lightning checkpoint: the DiT under `backbone.` in `state_dict`; with EMA on, `ema` =
  {"shadow_params": [...]} in the order of `backbone.parameters()` (its trainer averages the
  backbone's and the parameter-free noise schedule's parameters); the run's config under
  `hyper_parameters["config"]` (an omegaconf DictConfig).
- a huggingface_hub `PyTorchModelHubMixin` directory: `model.safetensors` (the DiT's state dict)
  and `config.json` (the constructor's arguments: the run config's sections and `vocab_size`).

The paper's DiT and ours (modeling_dllm.py) are the same function: pre-norm blocks with adaLN-zero
(shift, scale, gate for attention and MLP from Linear(c)), c = SiLU(MLP(sinusoids(sigma)))
with 256 sinusoids of max period 10000, bias-free weight-only LayerNorms (eps 1e-5), rotary
(base 10000, full head, halves rotated), qkv rows [3, heads, head_dim] without bias, tanh-GELU
MLP of width 4h with biases, final LN + adaLN(shift, scale) + Linear(h, V) with bias, untied
embedding. Its names are ours except `vocab_embed.embedding` (ours `vocab_embed.weight`); its
`rotary_emb.inv_freq` buffer is checked and dropped. What this module cannot represent exactly
(no adaLN, another time-embedding or MLP width, other tensors) is refused, never approximated.
"""
from __future__ import annotations

import json
import os

import torch

from megatron_dllm.errors import InputError
from megatron_dllm.hf import safe_load
from megatron_dllm.model import constants

# The paper code's algorithm names (configs/algo/*.yaml `name`) -> our families.
ALGO_FAMILIES = {"ar": "ar", "mdlm": "mdlm", "esolm": "esolm", "duo": "duo", "duo_base": "duo",
                 "distillation": "duo"}
_INV_FREQ = "rotary_emb.inv_freq"
_BLOCK = ["norm1.weight", "attn_qkv.weight", "attn_out.weight", "norm2.weight", "mlp.0.weight", "mlp.0.bias",
          "mlp.2.weight", "mlp.2.bias", "adaLN_modulation.weight", "adaLN_modulation.bias"]
_HEAD = ["vocab_embed.embedding", "sigma_map.mlp.0.weight", "sigma_map.mlp.0.bias", "sigma_map.mlp.2.weight",
         "sigma_map.mlp.2.bias"]
_TAIL = ["output_layer.norm_final.weight", "output_layer.linear.weight", "output_layer.linear.bias",
         "output_layer.adaLN_modulation.weight", "output_layer.adaLN_modulation.bias"]


def parameter_names(num_layers: int) -> list[str]:
    """The DiT's parameters in `parameters()` order: registration order of its modules
    (vocab_embed, sigma_map, blocks, output_layer; in a block norm1, attn_qkv, attn_out, norm2, mlp,
    adaLN_modulation; in the final layer norm_final, linear, adaLN_modulation)."""
    blocks = [f"blocks.{i}.{name}" for i in range(num_layers) for name in _BLOCK]
    return _HEAD + blocks + _TAIL


class RefCheckpoint:
    """The paper's DiT weights (fp32, the paper's names without `backbone.`) and its run config."""

    def __init__(self, weights: dict, config: dict, source: str):
        if not isinstance(config, dict):
            raise InputError(f"{source}: the run config is {type(config).__name__} {config!r:.60}, not a mapping")
        self.weights, self.config, self.source = weights, config, source

    def section(self, name: str) -> dict:
        """The config's `model` or `algo` section ({} where absent, kept); anything but a mapping is refused."""
        value = self.config.setdefault(name, {})
        if not isinstance(value, dict):
            raise InputError(f"{self.source}: config {name} is {type(value).__name__} {value!r:.60}, not a "
                             f"mapping of settings")
        return value

    # ------------------------------------------------------------------ architecture

    def sizes(self) -> dict:
        """hidden_size, num_layers, num_heads, vocab_size, cond_dim from the tensors (heads from
        the rotary buffer's length = head_dim / 2, else the config), checked against the config."""
        w, src = self.weights, self.source
        if "vocab_embed.embedding" not in w:
            raise InputError(f"{src}: no vocab_embed.embedding tensor; is it a checkpoint of the paper's DiT?")
        if w["vocab_embed.embedding"].dim() != 2:
            raise InputError(f"{src}: vocab_embed.embedding has shape {tuple(w['vocab_embed.embedding'].shape)}, "
                             f"expected [vocabulary, hidden]")
        vocab, hidden = w["vocab_embed.embedding"].shape
        layers = len({k.split(".")[1] for k in w if k.startswith("blocks.")})
        model = self.section("model")
        heads = model.get("n_heads")
        if _INV_FREQ in w:
            if not 0 < 2 * w[_INV_FREQ].numel() <= hidden:
                raise InputError(f"{src}: rotary_emb.inv_freq has {w[_INV_FREQ].numel()} values; a head of "
                                 f"hidden size {hidden} or less has 1 to {hidden // 2}")
            from_buffer = hidden // (2 * w[_INV_FREQ].numel())
            if heads is not None and heads != from_buffer:
                raise InputError(f"{src}: config model.n_heads {heads} but the rotary buffer has head_dim "
                                 f"{2 * w[_INV_FREQ].numel()} (= {from_buffer} heads)")
            heads = from_buffer
        if heads is None:
            raise InputError(f"{src}: the number of heads is neither in a config (model.n_heads) nor in a "
                             f"rotary_emb.inv_freq buffer; pass --num-attention-heads")
        if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or hidden % heads:
            raise InputError(f"{src}: model.n_heads {heads!r}, expected a positive integer dividing the hidden "
                             f"size {hidden}")
        for key, value in (("hidden_size", hidden), ("n_blocks", layers)):
            if key in model and model[key] != value:
                raise InputError(f"{src}: config model.{key} {model[key]} but the weights have {value}")
        if self.config.get("vocab_size") not in (None, vocab):
            raise InputError(f"{src}: config vocab_size {self.config['vocab_size']} but the embedding has {vocab} rows")
        cond = w["sigma_map.mlp.0.weight"].shape[0] if "sigma_map.mlp.0.weight" in w else None
        return {"hidden_size": int(hidden), "num_layers": layers, "num_heads": int(heads),
                "vocab_size": int(vocab), "cond_dim": cond}

    def family(self, given: str | None) -> str:
        """--family, else from the config's algo section (its `name`); they must agree with its
        attention (`causal_attention` only for ar), its time input (`time_conditioning` only for
        duo) and, for esolm, `alpha_0` = 1 and causal attention modes."""
        algo = self.section("algo")
        inferred = ALGO_FAMILIES.get(algo["name"]) if isinstance(algo.get("name"), str) else None
        if given is None and inferred is None:
            why = f"algo.name {algo['name']!r} is not one of {', '.join(ALGO_FAMILIES)}" if "name" in algo else \
                "it holds no config with an algo section"
            raise InputError(f"{self.source}: cannot infer the family ({why}); pass --family ar|mdlm|duo|esolm")
        family = given or inferred
        if given and inferred and given != inferred:
            raise InputError(f"--family {given} but {self.source} was trained as algo {algo['name']!r} ({inferred})")
        if "causal_attention" in algo and bool(algo["causal_attention"]) != (family == "ar"):
            raise InputError(f"{self.source}: algo.causal_attention {algo['causal_attention']} does not fit "
                             f"family {family} (causal attention is the ar family's)")
        # the time input the backbone was trained with: sigma for duo, zero for the others (as the
        # paper's configs set algo.time_conditioning); another one gives other logits
        if "time_conditioning" in algo and bool(algo["time_conditioning"]) != (family == "duo"):
            raise InputError(f"{self.source}: algo.time_conditioning {algo['time_conditioning']} does not fit "
                             f"family {family} (its backbone's time input is "
                             f"{'sigma' if family == 'duo' else 'zero'})")
        if family == "esolm" and algo.get("alpha_0", 1.0) != 1.0:
            raise InputError(f"{self.source}: algo.alpha_0 {algo['alpha_0']}; the esolm family implements "
                             f"alpha_0 = 1 only")
        if family == "esolm":
            for key in ("diffusion_attn_mode", "sequential_attn_mode"):
                if algo.get(key, "causal") != "causal":
                    raise InputError(f"{self.source}: algo.{key} {algo[key]!r}; the esolm family implements "
                                     f"'causal' only")
        return family

    def seq_length(self) -> int | None:
        return self.section("model").get("length")

    # ------------------------------------------------------------------ conversion

    def hf_state(self) -> dict:
        """Our dense DiT's state dict ("backbone." + name, fp32): every tensor of the paper's DiT
        mapped exactly, or an error naming what cannot be."""
        w, src = self.weights, self.source
        sizes = self.sizes()
        if self.section("algo").get("adaLN") is False or sizes["cond_dim"] is None:
            raise InputError(f"{src}: a DiT without adaLN time conditioning (algo.adaLN false) is not "
                             f"supported; every configuration of the paper's code uses adaLN")
        expected = parameter_names(sizes["num_layers"])
        missing = [k for k in expected if k not in w]
        extra = sorted(set(w) - set(expected) - {_INV_FREQ})
        if missing or extra:
            raise InputError(f"{src}: not the paper's DiT layout: missing {missing[:4]}, unexpected {extra[:4]}")
        self._check_fixed_sizes(sizes)
        shapes = _dense_shapes(sizes)
        out = {}
        for name in expected:
            ours = "backbone." + ("vocab_embed.weight" if name == "vocab_embed.embedding" else name)
            if not torch.isfinite(w[name]).all():
                raise InputError(f"{src}: {name} holds NaN or infinite values; a model with them computes "
                                 f"NaN logits, so it is not converted")
            value = w[name].float().contiguous()
            if tuple(value.shape) != shapes[ours]:
                raise InputError(f"{src}: {name} has shape {tuple(value.shape)}, expected {shapes[ours]} for "
                                 f"hidden {sizes['hidden_size']}, {sizes['num_heads']} heads, vocabulary "
                                 f"{sizes['vocab_size']}")
            out[ours] = value
        return out

    def _check_fixed_sizes(self, sizes: dict) -> None:
        w, src, d = self.weights, self.source, sizes["hidden_size"]
        fixed = {"sigma_map.mlp.0.weight": (constants.COND_DIM, constants.TIME_FREQ_DIM),
                 "blocks.0.mlp.0.weight": (4 * d, d)}
        for name, shape in fixed.items():
            if name in w and tuple(w[name].shape) != shape:
                raise InputError(f"{src}: {name} has shape {tuple(w[name].shape)}; this project's DiT has "
                                 f"{shape} (time embedding {constants.TIME_FREQ_DIM} -> {constants.COND_DIM}, "
                                 f"MLP width 4h)")
        if d % sizes["num_heads"]:
            raise InputError(f"{src}: hidden size {d} is not a multiple of {sizes['num_heads']} heads")
        if _INV_FREQ in w:
            head_dim = d // sizes["num_heads"]
            want = 1.0 / constants.ROTARY_BASE ** (torch.arange(0, head_dim, 2).float() / head_dim)
            buffer = w[_INV_FREQ]
            # A checkpoint saved in bf16/fp16 holds the buffer rounded to that precision.
            rtol = max(1e-5, torch.finfo(buffer.dtype).eps) if buffer.is_floating_point() else 0
            if not buffer.is_floating_point() or not torch.allclose(buffer.float(), want, rtol=rtol, atol=0):
                raise InputError(f"{src}: rotary_emb.inv_freq is not base {constants.ROTARY_BASE:g} over "
                                 f"head_dim {head_dim}")


def _dense_shapes(sizes: dict) -> dict:
    """Tensor shapes of our dense DiT of these sizes (built on the meta device: no memory)."""
    from megatron_dllm.hf.configuration_dllm import DLLMConfig
    from megatron_dllm.hf.modeling_dllm import DiT

    config = DLLMConfig(hidden_size=sizes["hidden_size"], num_layers=sizes["num_layers"],
                        num_heads=sizes["num_heads"], vocab_size=sizes["vocab_size"],
                        mask_token_id=sizes["vocab_size"] - 1)
    with torch.device("meta"):
        model = DiT(config)
    return {"backbone." + k: tuple(v.shape) for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------- readers


def read(path: str, weights: str = "raw") -> RefCheckpoint:
    """A Lightning `.ckpt` file or a hub-mixin directory; `weights` 'raw' or 'ema' (Lightning only)."""
    if weights not in ("raw", "ema"):
        raise InputError(f"--weights {weights!r}: expected raw or ema")
    if os.path.isdir(path):
        if weights == "ema":
            raise InputError(f"--weights ema: {path} is a hub-mixin directory, which holds one set of "
                             f"weights; EMA is chosen in a Lightning checkpoint")
        return read_hub_dir(path)
    if not os.path.isfile(path):
        raise InputError(f"--ref {path}: no such file or directory (expected a Lightning .ckpt or a "
                         f"directory with config.json and model.safetensors)")
    return read_lightning(path, weights == "ema")


def read_hub_dir(path: str) -> RefCheckpoint:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights_path, config_path = os.path.join(path, "model.safetensors"), os.path.join(path, "config.json")
    if not os.path.isfile(weights_path):
        raise InputError(f"--ref {path}: model.safetensors not found (expected a hub-mixin directory)")
    config = {}
    if os.path.isfile(config_path):
        try:
            with open(config_path) as f:
                config = json.load(f)
        except json.JSONDecodeError as err:
            raise InputError(f"--ref {config_path}: not valid JSON ({err})") from None
        if not isinstance(config, dict):
            raise InputError(f"--ref {config_path}: expected a JSON object")
    try:
        state = load_file(weights_path)
    except SafetensorError as err:
        raise InputError(f"--ref {weights_path}: unreadable safetensors file ({err})") from None
    return RefCheckpoint(state, config.get("config", config), weights_path)


def plain(value):
    """A config as plain dicts/lists: placeholders of omegaconf containers (their pickled state:
    `_content` holds the children, `_val` a node's value), mappings and sequences."""
    if isinstance(value, safe_load.Placeholder):
        for items in ("_items", "_list"):
            if items in value.__dict__:
                return plain(value.__dict__[items])
        state = value.__dict__.get("_state")
        if isinstance(state, tuple):  # (dict state, slots state)
            state = state[0]
        if not isinstance(state, dict):
            return None
        if "_content" in state:
            return plain(state["_content"])
        return plain(state.get("_val"))
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def read_lightning(path: str, use_ema: bool) -> RefCheckpoint:
    ckpt = safe_load.torch_load(path, f"--ref {path}")  # runs no code from the file
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise InputError(f"--ref {path}: no state_dict (expected a PyTorch Lightning checkpoint)")
    prefix = "backbone."
    raw = {k[len(prefix):]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
    if not raw:
        raise InputError(f"--ref {path}: no backbone.* tensors in state_dict (expected the paper's trainer)")
    not_tensors = [k for k, v in raw.items() if not isinstance(v, torch.Tensor)]
    if not_tensors:
        raise InputError(f"--ref {path}: state_dict entry backbone.{not_tensors[0]} is not a tensor")
    hparams = ckpt.get("hyper_parameters") or {}
    try:
        if isinstance(hparams, safe_load.Placeholder):  # an omegaconf DictConfig, as Lightning saves one
            hparams = plain(hparams)
        config = plain(hparams.get("config", {})) if isinstance(hparams, dict) else {}
    except RecursionError:
        raise InputError(f"--ref {path}: hyper_parameters nest too deep (or hold a cycle)") from None
    if not isinstance(config, dict):
        config = {}
    if use_ema:
        raw = _ema_weights(ckpt.get("ema"), raw, path)
    return RefCheckpoint(raw, config, path)


def _ema_weights(ema, raw: dict, path: str) -> dict:
    """The backbone with its parameters replaced by EMA's shadow parameters, matched by position in
    `parameters()` order and checked by shape; buffers stay."""
    if not isinstance(ema, dict) or "shadow_params" not in ema:
        raise InputError(f"--weights ema: {path} holds no EMA (no ema.shadow_params; trained with "
                         f"training.ema <= 0?); use --weights raw")
    shadow = ema["shadow_params"]
    if not isinstance(shadow, (list, tuple)):
        raise InputError(f"--weights ema: {path}: ema.shadow_params is {type(shadow).__name__}, not a list")
    layers = len({k.split(".")[1] for k in raw if k.startswith("blocks.")})
    names = parameter_names(layers)
    if len(shadow) != len(names) or any(n not in raw for n in names):
        raise InputError(f"--weights ema: {path} has {len(shadow)} EMA tensors for a backbone of "
                         f"{len(names)} parameters; cannot match them")
    out = dict(raw)
    for name, value in zip(names, shadow):
        if not isinstance(value, torch.Tensor):
            raise InputError(f"--weights ema: {path}: the EMA entry for {name} is not a tensor")
        if tuple(value.shape) != tuple(raw[name].shape):
            raise InputError(f"--weights ema: {path}: EMA tensor for {name} has shape {tuple(value.shape)}, "
                             f"the parameter {tuple(raw[name].shape)}")
        out[name] = value
    return out


def default_max_length(ref: RefCheckpoint, fallback: int) -> int:
    length = ref.seq_length()
    return int(length) if isinstance(length, int) and length > 0 else fallback

