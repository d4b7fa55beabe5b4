"""Shared by the torchrun workers that check a loss on each rank's vocabulary shard: every rank's
per-case results gathered and reduced to the worst (the largest error, a check that holds only if it
holds on every rank), written as JSON by the last rank for the test that launched them."""
import json

import torch.distributed as dist


def write_worst(results: dict[str, dict], path: str) -> None:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, results)
    if dist.get_rank() == dist.get_world_size() - 1:
        worst = {case: {field: (all(r[case][field] for r in every) if isinstance(value, bool)
                                else max(r[case][field] for r in every))
                        for field, value in fields.items()}
                 for case, fields in every[0].items()}
        with open(path, "w") as f:
            json.dump(worst, f)
