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
                                                "(the paper's 1.7B runs: 0.01; MDLM, Duo and Eso-LM, not with --sft)")
    demo_cache_dir: str | None = flag(help="where the embedded demo corpus is prepared "
                                           "(default ~/.cache/megatron_dllm/demo)")


@dataclass(frozen=True)
class TokenizerConfig(FlagGroup):
    GROUP = "tokenizer"
    tokenizer_type: str | None = flag(choices=list(TOKENIZER_TYPES), help="the tokenizer's format")
    tokenizer_model: str | None = flag(help="SentencePiece .model, tokenizer.json (or its directory), a .tiktoken "
                                            "file, or Megatron-LM's TikTokenizer JSON vocabulary (.json): the "
                                            "tokenizer the data was made with")
    tiktoken_pattern: str | None = flag(help="TikTokenizer pre-tokenisation regex: .tiktoken: llama3 (default, "
                                             "cl100k-style), cl100k, o200k, or a literal regex; Megatron JSON: "
                                             "v1 or v2 (default)")
    tiktoken_special_tokens: list | None = flag(nargs="+", help="TikTokenizer special tokens, given ids after the "
                                                                "last rank (default: <|begin_of_text|> "
                                                                "<|end_of_text|>)")
    tiktoken_num_special_tokens: int | None = flag(type=positive_int,
                                                   help="pad the special tokens with <|reserved_special_token_i|> "
                                                        "up to this many (Llama 3: 256); Megatron JSON: ids "
                                                        "0..N-1 are specials, <SPECIAL_i> fillers (default 1000)")
    tokenizer_special_tokens: list | None = flag(nargs="+", help="Megatron JSON TikTokenizer: the named specials, "
                                                                 "ids 0.. in order (default: <unk> <s> </s> <mask> "
                                                                 "<pad> <cls> <sep>; must hold these seven)")
    vocab_size: int | None = flag(type=positive_int, help="Megatron JSON TikTokenizer: specials + ranks kept "
                                                          "(default 131072)")

    def options(self) -> dict:
        """The tokenizer class's options (TikTokenizer only)."""
        from megatron_dllm.config.validate import check_tokenizer_options

        check_tokenizer_options(self)
        if self.tokenizer_type != "TikTokenizer":
            return {}
        specials = self.tokenizer_special_tokens if self.tokenizer_special_tokens is not None \
            else self.tiktoken_special_tokens
        return {"pattern": self.tiktoken_pattern, "special_tokens": specials,
                "num_special_tokens": self.tiktoken_num_special_tokens, "vocab_size": self.vocab_size}

    @classmethod
    def from_options(cls, tokenizer_type: str, tokenizer_model: str, options: dict | None) -> "TokenizerConfig":
        """The config whose `options()` are `options` (a checkpoint's tokenizer record)."""
        o = options or {}
        return cls(tokenizer_type, tokenizer_model, tiktoken_pattern=o.get("pattern"),
                   tiktoken_num_special_tokens=o.get("num_special_tokens"),
                   tokenizer_special_tokens=o.get("special_tokens"), vocab_size=o.get("vocab_size"))

    def build(self):
        from megatron_dllm.data.tokenizers import build_tokenizer

        return build_tokenizer(self.tokenizer_type, self.tokenizer_model, **self.options())
