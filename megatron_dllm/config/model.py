"""What model is trained: family, size, layer implementation, precision."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_dllm.config.fields import FlagGroup, flag, fraction, positive_int, switch
from megatron_dllm.model.presets import ALIASES, PRESETS

# what --recompute-modules takes: Megatron-LM's names of what the DiT's layer (and the GPT backbone's)
# recompute, and mlp_act, this project's: a dense MLP's activation (Megatron-LM's moe_act is MoE-only)
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "mlp_act")


@dataclass(frozen=True)
class ModelConfig(FlagGroup):
    GROUP = "model"
    family: str = flag("mdlm", help="model family: ar | mdlm | duo | esolm | bd3lm")
    loss: str | None = flag(help="training objective; mdlm, esolm: low-var (default) | nelbo; duo, bd3lm: nelbo; "
                                 "ar: nll")
    # BD3-LM (block diffusion); flag names as in the BD3-LM code's config (block_size, sampling_eps_*)
    block_size: int | None = flag(type=positive_int, help="--family bd3lm: tokens per block (divides --seq-length); "
                                                          "1 is autoregressive, --seq-length is MDLM/Duo")
    noise: str = flag("mask", choices=["mask", "uniform"],
                      help="--family bd3lm: the forward process inside a block, MDLM's mask or Duo's uniform")
    sampling_eps_min: float = flag(1e-3, type=fraction,
                                   help="--family bd3lm: training draws each block's t from U[min, max] (the "
                                        "clipped schedule, e.g. 0.5 with max 1 for B = 4); validation uses [1e-3, 1]")
    sampling_eps_max: float = flag(1.0, type=fraction, help="--family bd3lm: see --sampling-eps-min")

    def backbone_length(self) -> int:
        """Positions the backbone runs per sample: BD3-LM's input is [x_t ; x_0], twice --seq-length
        (what FLOP counts and the pipeline's activation shapes must use)."""
        from megatron_dllm.families import FAMILIES

        return self.seq_length * FAMILIES[self.family].input_copies

    def family_options(self) -> dict:
        """The family's own settings, as `families.get_family` takes them: the family reads and
        checks its flags (`Family.options_from_flags`, in the family's file)."""
        from megatron_dllm.families import FAMILIES

        return FAMILIES[self.family].options_from_flags(self)

    preset: str | None = flag(help=f"model size: {', '.join([*PRESETS, *ALIASES])}; default cpu-small on the "
                                   f"embedded demo, else 14M")
    num_layers: int | None = flag(type=positive_int, help="overrides the preset")
    hidden_size: int | None = flag(type=positive_int, help="overrides the preset")
    num_attention_heads: int | None = flag(type=positive_int, help="overrides the preset")
    seq_length: int | None = flag(type=positive_int, help="default 2048 (128 on the demo)")
    make_vocab_size_divisible_by: int = flag(128, type=positive_int, help="vocabulary padding multiple (x TP)")
    transformer_impl: str | None = flag(choices=["local", "transformer_engine"],
                                        help="default: transformer_engine when installed on a GPU, else local")
    attention_backend: str | None = flag(choices=["local", "sdpa", "unfused", "fused", "flash", "auto"],
                                         help="core attention: local (megatron-core) | sdpa (PyTorch's fused "
                                              "kernels, cuDNN/flash on GPU) | unfused, fused, flash, auto "
                                              "(TransformerEngine); default: auto with TE layers, else local")
    attention_mask_anneal_iters: int | None = flag(
        type=positive_int, help="--family mdlm/duo adapted from an AR model (DiffuLLaMA): attention goes from causal "
                                "to bidirectional over this many iterations, iteration k also opening each later "
                                "token with probability k/N; --attention-backend local or sdpa")
    recompute_activations: bool = flag(False, action="store_true",
                                       help="selective activation recompute (Megatron-LM: = --recompute-granularity "
                                            "selective)")
    recompute_granularity: str | None = flag(choices=["full", "selective"],
                                             help="full: keep each recomputed layer's input only; selective: "
                                                  "recompute --recompute-modules")
    recompute_modules: list | None = flag(nargs="+", choices=RECOMPUTE_MODULES,
                                          help="selective recompute (Megatron-LM's names; default core_attn): "
                                               "core_attn (core attention), layernorm (the norms' outputs, "
                                               "released after use), mlp (the whole MLP), mlp_act (the "
                                               "MLP's activation only, not a Megatron-LM name)")
    recompute_method: str | None = flag(choices=["uniform", "block"],
                                        help="full recompute: uniform (every group of --recompute-num-layers) | "
                                             "block (the first --recompute-num-layers layers of each stage)")
    recompute_num_layers: int | None = flag(type=positive_int, help="full recompute: layers per group (uniform) "
                                                                    "or recomputed layers per stage (block)")
    # Megatron-LM's fusion flags (it spells the --no- forms; both forms here, absent = the platform's
    # default) and the DiT's own compiled regions; their meanings: model/fusion.py.
    bias_gelu_fusion: bool | None = switch("the MLP's bias + tanh-GELU as megatron-core's fused kernel "
                                           "(default: on with CUDA, off on CPU)")
    bias_swiglu_fusion: bool | None = switch("--backbone gpt with --swiglu: megatron-core's fused SwiGLU "
                                             "(default: on with CUDA, off on CPU)")
    bias_dropout_fusion: bool | None = switch("the MLP's bias added inside the bias + gate + residual region "
                                              "(no dropout in the DiT; default on)")
    masked_softmax_fusion: bool | None = switch("--attention-backend local: apex's fused scale + mask + softmax "
                                                "(default: on where apex's kernels are installed)")
    rope_fusion: bool | None = switch("TransformerEngine's fused RoPE: not for the DiT's per-sample positions "
                                      "(--no-rope-fusion is accepted, --rope-fusion is an error)")
    compile_elementwise: bool | None = switch("torch.compile the DiT's LayerNorm + modulation, bias + gate + "
                                              "residual and rotary embedding, and the loss heads' vocabulary "
                                              "work (default: on with CUDA, off on CPU)")
    gradient_accumulation_fusion: bool | None = switch("add each weight gradient into its fp32 main gradient "
                                                       "inside the weight-gradient GEMM (default: on with CUDA "
                                                       "where torch can, off on CPU)")
    # Megatron-LM's CUDA-graph flags; only the full-iteration graph (training/cuda_graph.py) is built here
    cuda_graph_impl: str = flag("none", choices=["none", "local", "transformer_engine"],
                                help="local with --cuda-graph-scope full_iteration: capture each training "
                                     "iteration's forward and backward once as a CUDA graph and replay it (GPU)")
    cuda_graph_scope: list | None = flag(nargs="+", choices=["full_iteration", "attn", "mlp", "moe", "moe_router",
                                                             "moe_preprocess", "mamba", "full"],
                                         help="full_iteration (the only scope of the DiT)")
    cuda_graph_warmup_steps: int = flag(3, type=positive_int,
                                        help="eager iterations before the capture (the compiled regions compile "
                                             "in the first)")

    def recompute(self) -> dict:
        """megatron-core's TransformerConfig recompute fields, as Megatron-LM derives them (the
        flags' combinations are checked by config/validate.py)."""
        granularity = self.recompute_granularity or ("selective" if self.recompute_activations else None)
        if granularity == "selective":
            return {"recompute_granularity": granularity, "recompute_modules": list(self.recompute_modules or
                                                                                    ["core_attn"])}
        if granularity != "full":
            return {"recompute_granularity": granularity}
        return {"recompute_granularity": "full", "recompute_method": self.recompute_method,
                "recompute_num_layers": self.recompute_num_layers or 1}

    def describe_recompute(self) -> str:
        """The recompute setting for the start-of-run line: "recompute off", "recompute selective
        (layernorm, mlp_act)", "recompute full (uniform, 1 layer a group)"."""
        chosen = self.recompute()
        granularity = chosen["recompute_granularity"]
        if granularity == "selective":
            return f"recompute selective ({', '.join(chosen['recompute_modules'])})"
        if granularity == "full":
            n, method = chosen["recompute_num_layers"], chosen["recompute_method"]
            each = f"{n} layer{'s' if n > 1 else ''} a group" if method == "uniform" else f"the first {n} of each stage"
            return f"recompute full ({method}, {each})"
        return "recompute off"

    def uses_te(self) -> bool:
        """TransformerEngine layers: --transformer-impl, by default where TransformerEngine is installed."""
        from megatron_dllm import platform

        return platform.HAS_TE if self.transformer_impl is None else self.transformer_impl == "transformer_engine"

    def fusion(self, use_te: bool):
        """The run's fused elementwise work (model.fusion.Fusion), platform defaults filled in."""
        from megatron_dllm.model.attention import resolve_backend
        from megatron_dllm.model.fusion import resolve_fusion

        return resolve_fusion(resolve_backend(self.attention_backend, use_te), bias_gelu=self.bias_gelu_fusion,
                              bias_swiglu=self.bias_swiglu_fusion, bias_dropout=self.bias_dropout_fusion,
                              masked_softmax=self.masked_softmax_fusion, rope=self.rope_fusion,
                              compile_elementwise=self.compile_elementwise,
                              gradient_accumulation=self.gradient_accumulation_fusion)


@dataclass(frozen=True)
class PrecisionConfig(FlagGroup):
    GROUP = "precision"
    bf16: bool = flag(False, action="store_true", help="bf16 params and compute (GPU; CPU runs fp32)")
    fp8_format: str | None = flag(choices=["e4m3", "hybrid"], help="TransformerEngine FP8 (H100)")
    fp8_recipe: str = flag("delayed", choices=["delayed", "tensorwise", "blockwise", "mxfp8"],
                           help="FP8 scaling recipe")
    fp8_amax_history_len: int = flag(1, type=positive_int, help="delayed scaling: amax history length")
    fp8_amax_compute_algo: str = flag("most_recent", choices=["most_recent", "max"],
                                      help="delayed scaling: amax choice")
