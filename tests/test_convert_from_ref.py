"""tools/convert_from_ref.py: checkpoints in the layout of the paper's code convert into this project's
HF export and megatron checkpoint, and reproduce the logits of the paper's DiT.

`PaperDiT` below is an independent plain-torch implementation of the paper's models/dit.py (module
tree, parameter names and registration order, adaLN layout, rotary convention, time embedding,
output layer), written for this test. It writes the hub-mixin directory with huggingface_hub's own
`PyTorchModelHubMixin.save_pretrained`; the Lightning checkpoint is the dict the paper's trainer
saves (state_dict under `backbone.`, `ema.shadow_params` in parameters() order, hyper_parameters
with the run config as omegaconf pickles it and a transformers tokenizer, or the paper's own, all of
which the reader keeps as inert data).
"""
import contextlib
import copyreg
import math
import os
import sys
import types
import typing
from collections import OrderedDict, defaultdict

import huggingface_hub
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import REPO, launch_env, run_python

from megatron_dllm.cli import convert_from_ref
from megatron_dllm.hf import export, reference

HIDDEN, LAYERS, HEADS, VOCAB, SEQ, BATCH = 64, 2, 4, 300, 16, 3


# ------------------------------------------------------------------ the paper's DiT, independently


class PaperLayerNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.layer_norm(x.float(), [x.shape[-1]]) * self.weight


class PaperTimestepEmbedder(nn.Module):
    def __init__(self, cond_dim, freq=256):
        super().__init__()
        self.freq = freq
        self.mlp = nn.Sequential(nn.Linear(freq, cond_dim), nn.SiLU(), nn.Linear(cond_dim, cond_dim))

    def forward(self, t):
        half = self.freq // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
        args = t[:, None].float() * freqs[None]
        return self.mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=-1))


class PaperRotary(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10_000 ** (torch.arange(0, dim, 2).float() / dim)))

    def forward(self, positions):  # [b, s] -> cos, sin [b, s, 1, dim]
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
        return emb.cos(), emb.sin()


def rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class PaperBlock(nn.Module):
    def __init__(self, dim, n_heads, cond_dim):
        super().__init__()
        self.n_heads = n_heads
        self.norm1 = PaperLayerNorm(dim)
        self.attn_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.attn_out = nn.Linear(dim, dim, bias=False)
        self.dropout1 = nn.Dropout(0.1)
        self.norm2 = PaperLayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.dropout2 = nn.Dropout(0.1)
        self.adaLN_modulation = nn.Linear(cond_dim, 6 * dim)

    def forward(self, x, cos, sin, c, allowed):
        b, s, d = x.shape
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaLN_modulation(c)[:, None].chunk(6, dim=2)
        h = self.norm1(x) * (1 + scale1) + shift1
        q, k, v = self.attn_qkv(h).view(b, s, 3, self.n_heads, d // self.n_heads).unbind(dim=2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // self.n_heads)
        attn = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        y = torch.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, s, d)
        x = x + gate1 * self.attn_out(y)
        return x + gate2 * self.mlp(self.norm2(x) * (1 + scale2) + shift2)


class PaperEmbedding(nn.Module):
    def __init__(self, dim, vocab):
        super().__init__()
        self.embedding = nn.Parameter(torch.empty(vocab, dim))

    def forward(self, ids):
        return self.embedding[ids]


class PaperFinalLayer(nn.Module):
    def __init__(self, dim, vocab, cond_dim):
        super().__init__()
        self.norm_final = PaperLayerNorm(dim)
        self.linear = nn.Linear(dim, vocab)
        self.adaLN_modulation = nn.Linear(cond_dim, 2 * dim)

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c)[:, None].chunk(2, dim=2)
        return self.linear(self.norm_final(x) * (1 + scale) + shift)


class PaperDiT(nn.Module, huggingface_hub.PyTorchModelHubMixin):
    def __init__(self, config: dict, vocab_size: int):
        super().__init__()
        m = config["model"]
        self.causal = config["algo"]["causal_attention"] or config["algo"]["name"] == "esolm"
        self.vocab_embed = PaperEmbedding(m["hidden_size"], vocab_size)
        self.sigma_map = PaperTimestepEmbedder(m["cond_dim"])
        self.rotary_emb = PaperRotary(m["hidden_size"] // m["n_heads"])
        self.blocks = nn.ModuleList(PaperBlock(m["hidden_size"], m["n_heads"], m["cond_dim"])
                                    for _ in range(m["n_blocks"]))
        self.output_layer = PaperFinalLayer(m["hidden_size"], vocab_size, m["cond_dim"])

    def forward(self, ids, sigma, sort_idx=None):
        """Eso-LM: `ids` in the shuffled order and `sort_idx` their original positions; attention is
        causal over that order (its diffusion_attn_mode 'causal')."""
        b, s = ids.shape
        positions = torch.arange(s)[None].expand(b, s) if sort_idx is None else sort_idx
        cos, sin = self.rotary_emb(positions)
        allowed = torch.ones(s, s, dtype=torch.bool)
        if self.causal:
            allowed = allowed.tril()
        x = self.vocab_embed(ids)
        c = F.silu(self.sigma_map(sigma))
        for block in self.blocks:
            x = block(x, cos, sin, c, allowed)
        return self.output_layer(x, c)


def paper_config(algo: str) -> dict:
    algos = {"mdlm": {"name": "mdlm", "backbone": "dit", "causal_attention": False, "adaLN": True},
             "ar": {"name": "ar", "backbone": "dit", "causal_attention": True, "adaLN": True},
             "duo": {"name": "duo_base", "backbone": "dit", "causal_attention": False, "adaLN": True},
             "esolm": {"name": "esolm", "backbone": "esolm_dit", "causal_attention": False, "adaLN": True,
                       "diffusion_attn_mode": "causal", "sequential_attn_mode": "causal"}}
    return {"model": {"name": "test", "type": "ddit", "hidden_size": HIDDEN, "cond_dim": 128, "length": SEQ,
                      "n_blocks": LAYERS, "n_heads": HEADS, "scale_by_sigma": True, "dropout": 0.1,
                      "tie_word_embeddings": False},
            "algo": algos[algo]}


def random_paper_model(algo: str, seed: int = 0, vocab: int = VOCAB) -> PaperDiT:
    model = PaperDiT(paper_config(algo), vocab)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 16
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
    return model.eval()


class _PickledLikeOmegaconf:
    """Pickles as omegaconf 2.3's containers and nodes do: the class, then a state dict (`_content`
    of a container, `_val` of a node, `_metadata` with typing.Any and a defaultdict)."""

    def __init__(self, state):
        self.state = state

    def __reduce__(self):
        return copyreg.__newobj__, (type(self),), self.state


_OMEGACONF = {module: {name: type(name, (_PickledLikeOmegaconf,), {}) for name in names} for module, names in
              {"omegaconf.dictconfig": ["DictConfig"], "omegaconf.listconfig": ["ListConfig"],
               "omegaconf.nodes": ["AnyNode"], "omegaconf.base": ["ContainerMetadata", "Metadata"]}.items()}
_LIGHTNING = {"lightning.fabric.utilities.data": {"AttributeDict": type("AttributeDict", (dict,), {})}}


def omegaconf_like(value):
    """A plain config as omegaconf 2.3 pickles it (DictConfig/ListConfig of AnyNode leaves)."""
    def metadata(cls, **more):
        return cls(dict(ref_type=typing.Any, object_type=None, optional=True, key=None, flags={}, flags_root=False,
                        resolver_cache=defaultdict(dict), **more))
    base = _OMEGACONF["omegaconf.base"]
    if isinstance(value, dict):
        return _OMEGACONF["omegaconf.dictconfig"]["DictConfig"](
            {"_metadata": metadata(base["ContainerMetadata"], key_type=typing.Any, element_type=typing.Any),
             "_parent": None, "_content": {k: omegaconf_like(v) for k, v in value.items()}})
    if isinstance(value, list):
        return _OMEGACONF["omegaconf.listconfig"]["ListConfig"](
            {"_metadata": metadata(base["ContainerMetadata"]), "_parent": None,
             "_content": [omegaconf_like(v) for v in value]})
    return _OMEGACONF["omegaconf.nodes"]["AnyNode"]({"_metadata": metadata(base["Metadata"]), "_parent": None,
                                                     "_val": value})


@contextlib.contextmanager
def importable(classes: dict):
    """Make {module: {name: class}} importable by pickle (the libraries need not be installed; an
    installed one is set aside meanwhile)."""
    names = {".".join(m.split(".")[:i + 1]) for m in classes for i in range(m.count(".") + 1)}
    saved = {name: sys.modules.pop(name, None) for name in names}
    try:
        for name in names:
            sys.modules[name] = types.ModuleType(name)
        for module, members in classes.items():
            for name, cls in members.items():
                cls.__module__, cls.__qualname__ = module, name
                setattr(sys.modules[module], name, cls)
        yield
    finally:
        for name, module in saved.items():
            sys.modules.pop(name, None)
            if module is not None:
                sys.modules[name] = module


def paper_tokenizer():
    """A transformers tokenizer, as the paper's trainer keeps in its hyper-parameters."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2, "[UNK]": 3}, [("a", "b")], unk_token="[UNK]"))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="b", unk_token="[UNK]")


def save_lightning(model: PaperDiT, algo: str, path, ema_model: PaperDiT | None = None, edit=None,
                   hparams_class="dict", save=torch.save):
    """The dict the paper's Lightning trainer saves (changed by `edit`), written with `save`: the run
    config as omegaconf pickles it, a transformers tokenizer, and with `hparams_class` "lightning"
    hyper_parameters in Lightning's AttributeDict."""
    with importable({**_OMEGACONF, **_LIGHTNING}):
        hparams = _LIGHTNING["lightning.fabric.utilities.data"]["AttributeDict"] if hparams_class == "lightning" \
            else dict
        ckpt = {"epoch": 0, "global_step": 7, "pytorch-lightning_version": "2.5.0",
                "state_dict": OrderedDict(("backbone." + k, v.clone()) for k, v in model.state_dict().items()),
                "hyper_parameters": hparams(config=paper_config(algo), tokenizer=paper_tokenizer()),
                "loops": {"fit_loop": {}}, "optimizer_states": [], "lr_schedulers": [],
                "train_start_file_idx": 0}
        if ema_model is not None:
            ckpt["ema"] = {"decay": 0.9999, "num_updates": 7,
                           "shadow_params": [p.detach().clone() for p in ema_model.parameters()]}
        if edit is not None:
            edit(ckpt)
        ckpt["hyper_parameters"]["config"] = omegaconf_like(ckpt["hyper_parameters"]["config"])
        save(ckpt, path)
    return str(path)


def inputs(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    sigma = torch.rand(BATCH, generator=gen) * 3
    order = torch.stack([torch.randperm(SEQ, generator=gen) for _ in range(BATCH)])
    return ids, sigma, order


def convert_to_hf(tmp_path, *flags):
    out = tmp_path / "hf"
    assert convert_from_ref.main(["--ref", *flags, "--hf-out", str(out)]) == 0
    return out


def hf_logits(out, family, ids, sigma, positions=None):
    model = export.model_class(family).from_pretrained(str(out)).eval()
    assert model.config.family == family
    with torch.no_grad():
        return model(ids, position_ids=positions, sigma=sigma).logits


def assert_close(ours, theirs):
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert theirs.abs().max() > 1  # a non-trivial comparison


# ------------------------------------------------------------------ tests


def test_lightning_checkpoint_raw_and_ema_reproduce_the_paper_logits(tmp_path):
    raw, ema = random_paper_model("mdlm", seed=0), random_paper_model("mdlm", seed=5)
    ckpt = save_lightning(raw, "mdlm", tmp_path / "last.ckpt", ema_model=ema)
    ids, sigma, _ = inputs()
    with torch.no_grad():
        want_raw, want_ema = raw(ids, sigma), ema(ids, sigma)
    out_raw = convert_to_hf(tmp_path / "raw", ckpt, "--weights", "raw")
    out_ema = convert_to_hf(tmp_path / "ema", ckpt, "--weights", "ema")
    got_raw, got_ema = hf_logits(out_raw, "mdlm", ids, sigma), hf_logits(out_ema, "mdlm", ids, sigma)
    assert_close(got_raw, want_raw)
    assert_close(got_ema, want_ema)
    assert (got_raw - got_ema).abs().max() > 0.1  # EMA and raw are different weights


@pytest.mark.parametrize("algo", ["ar", "duo"])
def test_hub_mixin_directory_reproduces_the_paper_logits(algo, tmp_path):
    model = random_paper_model(algo, seed=2)
    model.save_pretrained(tmp_path / "hub")  # huggingface_hub writes config.json + model.safetensors
    out = convert_to_hf(tmp_path, str(tmp_path / "hub"))  # family inferred from config.json's algo.name
    ids, sigma, _ = inputs(3)
    with torch.no_grad():
        want = model(ids, sigma)
    assert_close(hf_logits(out, "ar" if algo == "ar" else "duo", ids, sigma), want)


def test_esolm_shuffled_order_reproduces_the_paper_logits(tmp_path):
    model = random_paper_model("esolm", seed=4)
    ckpt = save_lightning(model, "esolm", tmp_path / "esolm.ckpt", hparams_class="lightning")
    out = convert_to_hf(tmp_path, ckpt)  # the family comes from a config inside an AttributeDict
    ids, sigma, order = inputs(5)
    shuffled = torch.gather(ids, 1, order)
    with torch.no_grad():
        want = model(shuffled, sigma, sort_idx=order)
    assert_close(hf_logits(out, "esolm", shuffled, sigma, positions=order), want)


# tests/data/paper_hyper_parameters_omegaconf.pkl was written with omegaconf 2.3.0 as
#   pickle.dumps({"config": OmegaConf.create(RECORDED_CONFIG)}, protocol=2)
# (the pickle protocol of torch.save); its model and algo sections are the paper code's
# configs/model/6M.yaml and configs/algo/mdlm.yaml.
RECORDED_CONFIG = {
    "mode": "train",
    "model": {"name": "6M", "type": "ddit", "hidden_size": 256, "cond_dim": 128, "length": 1024, "n_blocks": 6,
              "n_heads": 4, "scale_by_sigma": True, "dropout": 0.1, "tie_word_embeddings": False},
    "algo": {"name": "mdlm", "backbone": "dit", "parameterization": "subs", "time_conditioning": False, "T": 0,
             "subs_masking": False, "causal_attention": False, "loss_type": "elbo", "adaLN": True},
    "loader": {"global_batch_size": 256, "eval_global_batch_size": "${.global_batch_size}"},
    "optim": {"weight_decay": 0.1, "lr": 2e-4, "min_lr": 2e-5, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8},
    "wandb": {"tags": ["chinchilla-v2", "${algo.name}"]},
}


def test_omegaconf_run_config_is_read_as_inert_data():
    from megatron_dllm.hf import safe_load

    with open(os.path.join(REPO, "tests", "data", "paper_hyper_parameters_omegaconf.pkl"), "rb") as f:
        hparams = safe_load.load_pickle(f)  # the allowlist: omegaconf's classes become inert placeholders
    config = reference.plain(hparams["config"])
    assert config == RECORDED_CONFIG
    ref = reference.RefCheckpoint({}, config, "recorded")
    assert ref.family(None) == "mdlm" and ref.seq_length() == 1024


@pytest.mark.slow
@pytest.mark.multiprocess
def test_megatron_checkpoint_at_tp2_reproduces_the_paper_logits(tmp_path):
    raw, ema = random_paper_model("mdlm", seed=0), random_paper_model("mdlm", seed=6)
    ckpt = save_lightning(raw, "mdlm", tmp_path / "last.ckpt", ema_model=ema)
    save = tmp_path / "ckpt_tp2"
    proc = run_python([os.path.join(REPO, "tools", "convert_from_ref.py"), "--ref", ckpt, "--weights", "ema",
                       "--save", str(save), "--tensor-model-parallel-size", "2"], REPO, launch_env(2), 300, nproc=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    from megatron_dllm import platform

    platform.init_distributed(1, 1)
    try:  # megatron reshards the TP=2 checkpoint into this one-rank model
        model, identity, _, _ = export.load_megatron_model(str(save))
        ids, sigma, _ = inputs(7)
        positions = torch.arange(SEQ)[None].expand(BATCH, SEQ)
        with torch.no_grad():
            got = model(ids, positions, sigma).transpose(0, 1)[..., :VOCAB]
            want = ema(ids, sigma)
    finally:
        platform.destroy_distributed()
    assert (identity.family, identity.vocab_size, identity.mask_id) == ("mdlm", VOCAB, VOCAB - 1)
    assert_close(got, want)


def test_a_checkpoint_holding_the_papers_own_tokenizer_converts(tmp_path, demo_cache):
    """The paper's main.py passes its dataloader.TinyLLamaTokenizer (a SentencePiece processor
    inside), which Lightning's save_hyperparameters pickles: inert data here, never its code."""
    import sentencepiece

    from megatron_dllm.data.prep.demo import prepare_demo_corpus

    class TinyLLamaTokenizer:
        def __init__(self, path):
            self.processor = sentencepiece.SentencePieceProcessor(model_file=path)

    model = random_paper_model("mdlm")
    with importable({"dataloader": {"TinyLLamaTokenizer": TinyLLamaTokenizer}}):
        tokenizer = TinyLLamaTokenizer(prepare_demo_corpus(demo_cache)["tokenizer_model"])
        ckpt = save_lightning(model, "mdlm", tmp_path / "tok.ckpt",
                              edit=lambda c: c["hyper_parameters"].update(tokenizer=tokenizer))
    ids, sigma, _ = inputs()
    with torch.no_grad():
        want = model(ids, sigma)
    assert_close(hf_logits(convert_to_hf(tmp_path / "out", ckpt), "mdlm", ids, sigma), want)


def test_refusals_name_the_input(tmp_path, capsys):
    model = random_paper_model("mdlm")
    ckpt = save_lightning(model, "mdlm", tmp_path / "noema.ckpt")
    save_lightning(model, "mdlm", tmp_path / "bias.ckpt", edit=lambda c: c["state_dict"].update(
        {"backbone.blocks.0.attn_qkv.bias": torch.zeros(3 * HIDDEN)}))
    save_lightning(model, "mdlm", tmp_path / "odd.ckpt",
                   edit=lambda c: c["hyper_parameters"]["config"]["algo"].update(name="sedd"))
    for name, change in (("timed", {"time_conditioning": True}), ("listed", {"name": ["mdlm"]})):
        save_lightning(model, "mdlm", tmp_path / f"{name}.ckpt",
                       edit=lambda c, change=change: c["hyper_parameters"]["config"]["algo"].update(change))
    save_lightning(random_paper_model("esolm"), "esolm", tmp_path / "alpha.ckpt",
                   edit=lambda c: c["hyper_parameters"]["config"]["algo"].update(alpha_0=0.5))
    hub = tmp_path / "hub"
    model.save_pretrained(hub)
    cases = [
        # a time input the family's backbone does not take: other logits, converted silently before
        (["--ref", str(tmp_path / "timed.ckpt")], "algo.time_conditioning True does not fit family mdlm"),
        (["--ref", str(tmp_path / "alpha.ckpt")], "algo.alpha_0 0.5; the esolm family implements alpha_0 = 1"),
        (["--ref", str(tmp_path / "listed.ckpt")], "cannot infer the family"),
        (["--ref", ckpt, "--weights", "ema"], "holds no EMA"),
        (["--ref", str(tmp_path / "bias.ckpt")], "unexpected ['blocks.0.attn_qkv.bias']"),
        (["--ref", str(tmp_path / "odd.ckpt")], "cannot infer the family (algo.name 'sedd'"),
        (["--ref", ckpt, "--family", "ar"], "--family ar but"),
        (["--ref", str(hub), "--weights", "ema"], "hub-mixin directory, which holds one set"),
        (["--ref", str(tmp_path / "missing.ckpt")], "no such file or directory"),
        (["--ref", ckpt, "--mask-id", str(VOCAB)], f"--mask-id {VOCAB}: outside"),
    ]
    for flags, message in cases:
        assert convert_from_ref.main([*flags, "--hf-out", str(tmp_path / "out")]) == 2, flags
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, (flags, err)
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_bare_weights_take_family_and_heads_from_flags(tmp_path, capsys):
    """A model.safetensors without config.json and without the rotary buffer: the family and the
    heads cannot be read from it, so they must be given."""
    from safetensors.torch import save_file

    model = random_paper_model("mdlm", seed=8)
    bare = tmp_path / "bare"
    bare.mkdir()
    save_file({k: v for k, v in model.state_dict().items() if k != "rotary_emb.inv_freq"},
              str(bare / "model.safetensors"))
    for flags, message in [([], "cannot infer the family (it holds no config"),
                           (["--family", "mdlm"], "pass --num-attention-heads")]:
        assert convert_from_ref.main(["--ref", str(bare), *flags, "--hf-out", str(tmp_path / "x")]) == 2
        assert message in capsys.readouterr().err
    out = convert_to_hf(tmp_path, str(bare), "--family", "mdlm", "--num-attention-heads", str(HEADS))
    ids, sigma, _ = inputs(9)
    with torch.no_grad():
        want = model(ids, sigma)
    assert_close(hf_logits(out, "mdlm", ids, sigma), want)


def train_sentencepiece(path, vocab_size: int) -> str:
    """A small BPE SentencePiece model (byte fallback) trained on this repository's own docs."""
    import io

    import sentencepiece as spm

    text = open(os.path.join(REPO, "docs", "checkpoints.md")).read() + open(os.path.join(REPO, "README.md")).read()
    text = text.encode("ascii", "ignore").decode()
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter([t for t in text.splitlines() if t.strip()]),
                                   model_writer=proto, vocab_size=vocab_size, model_type="bpe", byte_fallback=True,
                                   unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2)
    with open(path, "wb") as f:
        f.write(proto.getvalue())
    return str(path)


def test_tokenizer_gives_the_mask_id_and_is_exported(tmp_path, capsys):
    from transformers import AutoTokenizer

    vocab = 450  # room for the 256 byte pieces and the characters
    model = random_paper_model("mdlm", seed=10, vocab=vocab)
    ckpt = save_lightning(model, "mdlm", tmp_path / "last.ckpt")
    spm_model = train_sentencepiece(tmp_path / "tok.model", vocab - 1)  # + the appended [MASK] = vocab
    flags = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model"]
    out = convert_to_hf(tmp_path, ckpt, *flags, spm_model)
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.mask_token_id == vocab - 1
    assert export.model_class("mdlm").from_pretrained(str(out)).config.mask_token_id == vocab - 1
    import sentencepiece as spm

    text = "Checkpoints of the paper's code import here."
    ids = spm.SentencePieceProcessor(model_file=spm_model).encode(text)
    assert tok(text, add_special_tokens=False)["input_ids"] == ids
    small = train_sentencepiece(tmp_path / "small.model", vocab - 20)
    assert convert_from_ref.main(["--ref", ckpt, *flags, small, "--hf-out", str(tmp_path / "x")]) == 2
    assert f"but {ckpt} has {vocab} rows" in capsys.readouterr().err
    # --save records the tokenizer, so the checkpoint samples and exports with it untold
    save = tmp_path / "ckpt"
    proc = run_python([os.path.join(REPO, "tools", "convert_from_ref.py"), "--ref", ckpt, *flags, spm_model,
                       "--save", str(save)], REPO, launch_env(1), 300)
    assert proc.returncode == 0 and f"tokenizer {spm_model})" in proc.stdout, proc.stderr[-3000:]
    again = run_python([os.path.join(REPO, "tools", "convert_to_hf.py"), "--load", str(save), "--out",
                        str(tmp_path / "again")], REPO, launch_env(1), 300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert AutoTokenizer.from_pretrained(str(tmp_path / "again"))(text, add_special_tokens=False)["input_ids"] == ids
