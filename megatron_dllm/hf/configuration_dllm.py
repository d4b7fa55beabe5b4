"""Configuration of an exported megatron_dllm model (self-contained: copied into exported dirs):
the DiT, or with `gpt` (the shape of `--backbone gpt`) the Llama-style backbone.

The defaults of the fixed sizes (cond_dim ... layer_norm_eps) are megatron_dllm/model/constants.py's
values, which every export writes into its config.json."""
from transformers import PretrainedConfig


class DLLMConfig(PretrainedConfig):
    model_type = "dllm"
    attribute_map = {"num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
                     "n_positions": "max_position_embeddings"}

    def __init__(self, family="mdlm", hidden_size=256, num_layers=6, num_heads=4, vocab_size=32001,
                 mask_token_id=32000, cond_dim=128, time_freq_dim=256, time_max_period=10000.0,
                 noise_schedule="loglinear", noise_eps=1e-3, attention="bidirectional", rope_theta=10000.0,
                 layer_norm_eps=1e-5, max_position_embeddings=2048, gpt=None, **kwargs):
        self.family = family
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.vocab_size = vocab_size
        self.mask_token_id = mask_token_id
        self.cond_dim = cond_dim
        self.time_freq_dim = time_freq_dim
        self.time_max_period = time_max_period
        self.noise_schedule = noise_schedule
        self.noise_eps = noise_eps
        self.attention = attention
        self.rope_theta = rope_theta
        self.layer_norm_eps = layer_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.gpt = gpt  # the GPT (Llama-style) backbone's shape (GPTShape's fields); None: the DiT
        kwargs.setdefault("tie_word_embeddings", False)
        kwargs.setdefault("use_cache", False)  # no KV cache: generation recomputes the prefix
        super().__init__(**kwargs)
