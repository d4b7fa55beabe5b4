"""Which operations make the host wait for the device: a CUDA graph capture refuses them, and a
sampling loop that dispatches one waits for the GPU at every step. Counted on CPU by dispatch."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# Operations that read a device value on the host (CUDA waits for the device before returning).
SYNCHRONISING = {aten._local_scalar_dense, aten.nonzero, aten.is_nonzero, aten.masked_select, aten._unique2,
                 aten.unique_consecutive, aten.unique_dim, aten.equal, aten.bincount}


class Synchronisations(TorchDispatchMode):
    """Records the synchronising operations dispatched: those above, indexing by a boolean mask
    (its positions are counted on the host) and a masked write of a value that is not a scalar
    (a scalar takes masked_fill, which does not wait)."""

    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        masks = [i for i in (args[1] if packet in (aten.index, aten.index_put_, aten.index_put) else ())
                 if i is not None and i.dtype == torch.bool]
        if packet in SYNCHRONISING or (masks and (packet is aten.index or args[2].dim() > 0)):
            self.found.append(str(func))
        return func(*args, **(kwargs or {}))
