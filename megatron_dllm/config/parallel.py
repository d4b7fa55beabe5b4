"""How the model is split over ranks (megatron-core's parallel state and DDP)."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_dllm.config.fields import FlagGroup, flag, positive_int


@dataclass(frozen=True)
class ParallelConfig(FlagGroup):
    GROUP = "parallelism"
    tensor_model_parallel_size: int = flag(1, type=positive_int, help="TP size")
    pipeline_model_parallel_size: int = flag(1, type=positive_int, help="PP size")
    virtual_pipeline_model_parallel_size: int | None = flag(type=positive_int,
                                                            aliases=("--num-virtual-stages-per-pipeline-rank",),
                                                            help="model chunks per pipeline stage (interleaved 1F1B)")
    sequence_parallel: bool = flag(False, action="store_true", help="shard activations over TP along the sequence")
    use_distributed_optimizer: bool = flag(False, action="store_true", help="shard optimizer state over DP")
    overlap_grad_reduce: bool = flag(False, action="store_true", help="overlap the DP gradient reduction with backward")
