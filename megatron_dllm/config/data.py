"""Which token data the run reads, and the tokenizer it was made with."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_dllm.config.fields import FlagGroup, flag, fraction, split_spec


@dataclass(frozen=True)
class DataConfig(FlagGroup):
    GROUP = "data"
    data_path: list | None = flag(nargs="*", help="prefix | w1 prefix1 w2 prefix2 ... (no data flags: the embedded "
                                                   "demo corpus)")
    split: str = flag("969,30,1", type=split_spec, help="train,valid,test weights of --data-path")
    train_data_path: list | None = flag(nargs="*", help="per-split paths (Megatron-LM): the training blend, "
                                                         "with --valid-data-path")
    valid_data_path: list | None = flag(nargs="*", help="the validation blend")
    data_cache_path: str | None = flag(help="where index caches are written (default: beside the data)")
    variable_seq_length_prob: float = flag(0.0, type=fraction,
                                           help="probability that a micro-batch is cut to a length drawn from U[1, L] "
                                                "(the paper's 1.7B runs: 0.01; diffusion families only)")
    demo_cache_dir: str | None = flag(help="where the embedded demo corpus is prepared "
                                           "(default ~/.cache/megatron_dllm/demo)")


@dataclass(frozen=True)
class TokenizerConfig(FlagGroup):
    GROUP = "tokenizer"
    tokenizer_type: str | None = flag(help="SentencePieceTokenizer | HuggingFaceTokenizer | TikTokenizer")
    tokenizer_model: str | None = flag(help="the tokenizer model file (or directory) the data was made with")
