"""seed_for: how this project turns values into a random seed for training noise, evaluation draws
and sampling batches (weight initialisation derives its per-parameter seeds in model/init.py).
Self-contained (the standard library only): an HF export ships this file with its sampler code,
so `generate(seed=...)` of an export draws what megatron_dllm draws."""
import zlib


def seed_for(*values) -> int:
    """A 63-bit seed from values (stable across processes and Python versions)."""
    return zlib.crc32(b"/".join(str(v).encode() for v in values)) * 2_654_435_761 % 2**63
