"""torchrun worker (2 ranks): `sdpa` against `local` for every family at TP=2, without and with
sequence parallelism, in one launch; each rank's relative differences (its own logits and
gradient shards) to a JSON file."""
import json
import sys

import torch.distributed as dist
from attention_cases import FAMILIES, compare_backends

from megatron_dllm import platform


def main():
    out = sys.argv[1]
    platform.init_distributed(2, 1, seed=0)
    mine = {f"{family}/{layout}": compare_backends(family, "sdpa", tp=2, sequence_parallel=layout == "TP2-SP")
            for layout in ("TP2", "TP2-SP") for family in FAMILIES}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({case: [ranks[case] for ranks in gathered] for case in mine}, f)
    platform.destroy_distributed()


if __name__ == "__main__":
    main()
