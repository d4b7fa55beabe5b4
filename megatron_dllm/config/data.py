"""Which token data the run reads, and the tokenizer it was made with."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_dllm.config.fields import FlagGroup, flag, fraction, positive_int, split_spec
from megatron_dllm.data.tokenizers import TOKENIZER_TYPES


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
    tokenizer_type: str | None = flag(choices=list(TOKENIZER_TYPES), help="the tokenizer's format")
    tokenizer_model: str | None = flag(help="SentencePiece .model, tokenizer.json (or its directory), or a "
                                            ".tiktoken file: the tokenizer the data was made with")
    tiktoken_pattern: str | None = flag(help="TikTokenizer pre-tokenisation regex: llama3 (default, cl100k-style), "
                                             "cl100k, o200k, or a literal regex")
    tiktoken_special_tokens: list | None = flag(nargs="+", help="TikTokenizer special tokens, given ids after the "
                                                                "last rank (default: <|begin_of_text|> "
                                                                "<|end_of_text|>)")
    tiktoken_num_special_tokens: int | None = flag(type=positive_int,
                                                   help="pad the special tokens with <|reserved_special_token_i|> "
                                                        "up to this many (Llama 3: 256)")

    def options(self) -> dict:
        """The tokenizer class's options (TikTokenizer only)."""
        tiktoken = {"pattern": self.tiktoken_pattern, "special_tokens": self.tiktoken_special_tokens,
                    "num_special_tokens": self.tiktoken_num_special_tokens}
        if self.tokenizer_type != "TikTokenizer":
            given = [k for k, v in tiktoken.items() if v is not None]
            if given:
                raise ValueError(f"--tiktoken-{given[0].replace('_', '-')} applies to --tokenizer-type "
                                 f"TikTokenizer only")
            return {}
        return tiktoken

    def build(self):
        from megatron_dllm.data.tokenizers import build_tokenizer

        return build_tokenizer(self.tokenizer_type, self.tokenizer_model, **self.options())
