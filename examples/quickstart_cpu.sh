#!/usr/bin/env bash
# The embedded default on a laptop: both families on the Shakespeare demo, 2 ranks over gloo.
# Each run takes a few minutes on 2 cores and leaves runs/demo-<family>/{checkpoints,tensorboard}.
set -euo pipefail
for family in mdlm ar; do
  torchrun --nproc-per-node 2 pretrain_dllm.py --family "$family"
done
# Same code, other layouts: tensor+sequence parallel, or interleaved pipeline parallel (each
# resumes its own run when the script runs again; a finished one only evaluates).
torchrun --nproc-per-node 2 pretrain_dllm.py --family mdlm --tensor-model-parallel-size 2 --sequence-parallel \
  --train-iters 50 --save runs/demo-mdlm-tp2 --load runs/demo-mdlm-tp2
torchrun --nproc-per-node 2 pretrain_dllm.py --family mdlm --pipeline-model-parallel-size 2 \
  --virtual-pipeline-model-parallel-size 2 --train-iters 50 --save runs/demo-mdlm-vpp --load runs/demo-mdlm-vpp
