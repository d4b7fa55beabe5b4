"""The Eso-LM diffusion shuffle: clean tokens first, masked tokens after, each in random order.

From the mask pattern `is_mask` [b, L] (bool) and per-token keys `u` [b, L] (U(0,1), float64 or
float32) the permutation is

    sort_idx = argsort(key, stable=True),   key = is_mask + 0.9 * u      (computed in u's dtype)

i.e. clean tokens (keys in [0, 0.9)) before masked ones (keys in [1, 1.9)), each group in the order
of its keys. **Ties** (equal *computed* keys; note that 1 + 0.9u rounds away low bits of u, so
distinct u can tie among masked tokens) are broken by the original index, lowest first: the
order is the lexicographic order of (key, index). All three implementations give exactly this
permutation, bit for bit:

- `shuffle_torch` / `unpermute_torch`: the pure-torch reference (argsort + gathers), used when
  no extension serves and always differentiable;
- the C++ CPU extension `megatron_dllm._esolm_shuffle` (csrc/esolm_shuffle.cpp, pybind11 over raw
  buffers): per row a stable counting partition into clean/masked, a sort of each group by
  (key, index), and the gathers, in one pass; rows in parallel;
- the CUDA extension `megatron_dllm._esolm_shuffle_cuda` (csrc/esolm_shuffle_cuda.cu, built only
  where nvcc and a CUDA build of torch exist): one block per row, bitonic sort of (key, index)
  pairs in shared memory (L <= 4096), then the gathers.

`shuffle(is_mask, u, *tensors)` returns (sort_idx, *gathered): each [b, L] int64 tensor gathered
along the sequence (z_t, x0, position ids). `unpermute(x, sort_idx)` puts a [b, L, ...] tensor
back into sequence order (out[:, sort_idx[:, i]] = x[:, i]). Dispatch (`backend="auto"`, or env
`MEGATRON_DLLM_SHUFFLE_BACKEND`): CUDA kernel for CUDA tensors when built, C++ for CPU tensors
when built, torch otherwise. Tensors that require grad always take the torch path.
"""
from __future__ import annotations

import os

import torch

from megatron_dllm.errors import InputError

try:
    from megatron_dllm import _esolm_shuffle as _cpp
except ImportError:  # extension not built: the torch reference serves
    _cpp = None
try:
    from megatron_dllm import _esolm_shuffle_cuda as _cuda
except ImportError:  # built only where nvcc and a CUDA torch exist
    _cuda = None

HAVE_CPP, HAVE_CUDA = _cpp is not None, _cuda is not None
MASK_OFFSET, KEY_SCALE = 1.0, 0.9
BACKENDS = ("auto", "torch", "cpp", "cuda")
CUDA_MAX_LEN = 4096  # the kernel sorts one row in shared memory


def sort_keys(is_mask: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """key = is_mask + 0.9 * u in u's dtype (the reference's `is_mask + 0.9 * rand`)."""
    return is_mask.to(u.dtype) + KEY_SCALE * u


# ------------------------------------------------------------------------------ torch reference

def shuffle_torch(is_mask: torch.Tensor, u: torch.Tensor, *tensors: torch.Tensor):
    sort_idx = torch.argsort(sort_keys(is_mask, u), dim=1, stable=True)
    return (sort_idx, *(torch.gather(t, 1, sort_idx) for t in tensors))


def unpermute_torch(x: torch.Tensor, sort_idx: torch.Tensor) -> torch.Tensor:
    index = sort_idx.view(*sort_idx.shape, *([1] * (x.dim() - 2))).expand_as(x)
    return torch.empty_like(x).scatter_(1, index, x)


# ------------------------------------------------------------------------------ dispatch

def _backend(backend: str | None, device: torch.device, length: int, grad: bool = False) -> str:
    backend = backend or os.environ.get("MEGATRON_DLLM_SHUFFLE_BACKEND", "auto")
    if backend not in BACKENDS:
        raise InputError(f"shuffle backend {backend!r}: expected one of {BACKENDS}")
    if backend == "auto":
        if grad:
            return "torch"
        if device.type == "cuda" and HAVE_CUDA and length <= CUDA_MAX_LEN:
            return "cuda"
        if device.type == "cpu" and HAVE_CPP:
            return "cpp"
        return "torch"
    if backend == "cpp" and (not HAVE_CPP or device.type != "cpu"):
        raise RuntimeError("backend 'cpp' needs CPU tensors and megatron_dllm._esolm_shuffle "
                           "(pip install -e . --no-build-isolation --no-deps)")
    if backend == "cuda" and (not HAVE_CUDA or device.type != "cuda" or length > CUDA_MAX_LEN):
        raise RuntimeError(f"backend 'cuda' needs CUDA tensors, L <= {CUDA_MAX_LEN} and "
                           "megatron_dllm._esolm_shuffle_cuda (built where nvcc and CUDA torch exist)")
    return backend


def shuffle(is_mask: torch.Tensor, u: torch.Tensor, *tensors: torch.Tensor,
            backend: str | None = None):
    """(sort_idx, *gathered): the clean-first permutation of each row and each [b, L] int64
    tensor of `tensors` gathered with it."""
    if is_mask.shape != u.shape or is_mask.dim() != 2:
        raise ValueError(f"shuffle: is_mask {tuple(is_mask.shape)} and u {tuple(u.shape)} must be the same [b, L]")
    if u.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"shuffle: keys must be float32 or float64, got {u.dtype}")
    for t in tensors:
        if t.shape != u.shape:
            raise ValueError(f"shuffle: gathered tensor {tuple(t.shape)} is not [b, L] = {tuple(u.shape)}")
    grad = any(t.requires_grad for t in tensors)
    native = all(t.dtype == torch.int64 for t in tensors)
    which = _backend(backend, u.device, u.shape[1], grad or not native)
    if which == "torch":
        return shuffle_torch(is_mask, u, *tensors)
    mask = is_mask.to(torch.bool).contiguous().view(torch.uint8)
    keys = u.contiguous()
    srcs = [t.contiguous() for t in tensors]
    if which == "cuda":
        return tuple(_cuda.shuffle(mask, keys, srcs))
    sort_idx = torch.empty(u.shape, dtype=torch.int64)
    outs = [torch.empty(u.shape, dtype=torch.int64) for _ in srcs]
    _cpp.shuffle(mask.numpy(), keys.numpy(), [s.numpy() for s in srcs], sort_idx.numpy(),
                 [o.numpy() for o in outs], 0)
    return (sort_idx, *outs)


def unpermute(x: torch.Tensor, sort_idx: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """Back to sequence order: out[:, sort_idx[:, i]] = x[:, i] for x [b, L, ...]."""
    if x.shape[:2] != sort_idx.shape:
        raise ValueError(f"unpermute: x {tuple(x.shape)} does not start with sort_idx's {tuple(sort_idx.shape)}")
    which = _backend(backend, x.device, x.shape[1], x.requires_grad)
    if which == "torch":
        return unpermute_torch(x, sort_idx)
    x, idx = x.contiguous(), sort_idx.to(torch.int64).contiguous()
    if which == "cuda":
        return _cuda.unpermute(x, idx)
    out = torch.empty_like(x)
    b, length = idx.shape
    elem_bytes = x.numel() // max(b * length, 1) * x.element_size()
    _cpp.unpermute(x.reshape(-1).view(torch.uint8).numpy(), idx.numpy(),
                   out.view(-1).view(torch.uint8).numpy(), elem_bytes, 0)
    return out


def inverse(sort_idx: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """The inverse permutation (rank of each sequence position in the shuffled order)."""
    ranks = torch.arange(sort_idx.shape[1], device=sort_idx.device).expand_as(sort_idx).contiguous()
    return unpermute(ranks, sort_idx, backend)
