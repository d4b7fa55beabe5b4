"""The peak memory a piece of work allocates above what was allocated when it started:
`platform.allocated_bytes()` (the CUDA allocator's bytes on a GPU, the C allocator's bytes in use
on a CPU) sampled after every ATen operation. A temporary freed inside one operation is missed
(a matmul's workspace); everything an operation leaves behind is seen.

    with AllocatedPeak() as peak:
        work()
    peak.extra  # bytes
"""
from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

from megatron_dllm import platform


class AllocatedPeak(TorchDispatchMode):
    """The peak of bytes allocated above the entry's, sampled after every ATen operation."""

    def __enter__(self):
        platform.synchronize()
        self.base = self.top = platform.allocated_bytes()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.top = max(self.top, platform.allocated_bytes())
        return out

    @property
    def extra(self) -> int:
        return self.top - self.base
