"""The peak memory a piece of work allocates above what was allocated when it started: on a GPU
torch.cuda's own peak counter, on a CPU the C allocator's bytes in use (glibc's mallinfo2: heap
blocks plus the mmapped blocks large tensors get), sampled after every ATen operation. So a
temporary freed inside one operation is missed on a CPU, and everything an operation leaves
behind is seen.

    with AllocatedPeak() as peak:
        work()
    peak.extra  # bytes
"""
from __future__ import annotations

import ctypes

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _malloc_in_use() -> int:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd  # heap blocks in use + mmapped blocks (large tensors)


class AllocatedPeak(TorchDispatchMode):
    """The peak of bytes allocated above the entry's, sampled after every ATen operation (CPU);
    cuda's own peak counter on a GPU."""

    def __enter__(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.base = self.top = self.in_use()
        return super().__enter__()

    def in_use(self) -> int:
        return torch.cuda.memory_allocated() if torch.cuda.is_available() else _malloc_in_use()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not torch.cuda.is_available():
            self.top = max(self.top, self.in_use())
        return out

    @property
    def extra(self) -> int:
        top = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else self.top
        return top - self.base
