"""seed_for: the one way this project turns values into a random seed (training noise, evaluation
draws, sampling batches). Self-contained (the standard library only): an HF export ships this file
with its sampler code, so `generate(seed=...)` of an export draws what megatron_dllm draws."""
import zlib


def seed_for(*values) -> int:
    """A 63-bit seed from values (stable across processes and Python versions)."""
    return zlib.crc32(b"/".join(str(v).encode() for v in values)) * 2_654_435_761 % 2**63
