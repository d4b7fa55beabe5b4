"""megatron_dllm: Megatron-style pretraining of discrete diffusion language models."""
from setuptools import find_packages, setup

try:  # pybind11 is needed at build time; without it the numpy references serve at runtime
    from pybind11.setup_helpers import Pybind11Extension, build_ext
except ImportError:  # pragma: no cover
    Pybind11Extension = build_ext = None

# tools/convert_{to,from}_hf.py and the exported models (protobuf converts SentencePiece models).
HF_EXPORT = ["transformers>=5.0,<6", "safetensors>=0.4,<1", "protobuf>=3.20"]

ext_modules, cmdclass = [], {}
if Pybind11Extension is not None:
    # -ffp-contract=off: no FMA contraction, so floating-point comparisons stay bit-identical to
    # their references (megatron-core's blending greedy; the Eso-LM key is_mask + 0.9*u as torch
    # rounds it). optional=True: a failed compile warns and the Python references serve instead.
    ext_modules = [
        Pybind11Extension(name, [source], cxx_std=17, extra_compile_args=["-O3", "-ffp-contract=off"],
                          extra_link_args=["-pthread"], optional=True)
        for name, source in (("megatron_dllm._index_builders", "csrc/index_builders.cpp"),
                             ("megatron_dllm._esolm_shuffle", "csrc/esolm_shuffle.cpp"))
    ]
    cmdclass["build_ext"] = build_ext


def _cuda_shuffle_extension():
    """The Eso-LM shuffle's CUDA kernel, only where nvcc and a CUDA build of torch both exist
    (never under build isolation, where torch is not importable); None elsewhere."""
    import os
    import shutil
    import sys

    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except Exception:
        return None
    if torch.version.cuda is None or CUDA_HOME is None or not (shutil.which("nvcc") or CUDA_HOME):
        return None
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and torch.cuda.device_count() == 0:
        # torch builds for the visible GPUs' architectures and fails (IndexError) where none is visible
        print("setup.py: not building the Eso-LM shuffle's CUDA kernel: no GPU is visible and "
              "TORCH_CUDA_ARCH_LIST is unset (TORCH_CUDA_ARCH_LIST=9.0 builds it for H100)", file=sys.stderr)
        return None
    ext = CUDAExtension("megatron_dllm._esolm_shuffle_cuda", ["csrc/esolm_shuffle_cuda.cu"],
                        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]})
    ext.optional = True  # a failed CUDA compile never fails the install
    return ext, BuildExtension


_cuda_ext = _cuda_shuffle_extension()
if _cuda_ext is not None:
    ext_modules.append(_cuda_ext[0])
    cmdclass["build_ext"] = _cuda_ext[1].with_options(use_ninja=False)

setup(
    name="megatron_dllm",
    version="0.1.0",
    description="Megatron-core pretraining stack for AR, MDLM, Duo and Eso-LM language models",
    packages=find_packages(include=["megatron_dllm", "megatron_dllm.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16.1,<0.17",
        "numpy",
        "sentencepiece",
        "tensorboard",
        "pybind11",
        "tokenizers",
        "tiktoken>=0.7",
        "zstandard>=0.22",
        "pyarrow>=14",
        "psutil",
        "scipy",  # scaling-law fits (megatron_dllm/scaling/fits.py)
        "matplotlib",  # scaling-law figures (megatron_dllm/scaling/plots.py)
    ],
    extras_require={
        "hf": HF_EXPORT,
        "wandb": ["wandb"],  # --wandb-project (optional; WANDB_MODE=offline works without a network)
        # gguf + accelerate: transformers' GGUF loading (the SmolLM2 judge of tests/test_evaluate.py)
        # lm-eval: the downstream model class and its tests; wandb: the offline-run test of --wandb-project
        # pytest-xdist: the README's test command runs the files on two workers
        "test": ["pytest", "pytest-xdist", "ruff", *HF_EXPORT, "gguf>=0.10", "accelerate>=1.0", "lm-eval", "wandb"],
    },
    entry_points={"console_scripts": [
        "dllm-pretrain=megatron_dllm.cli.pretrain:main",
        "dllm-preprocess=megatron_dllm.cli.preprocess_data:main",
        "dllm-merge=megatron_dllm.cli.merge_datasets:main",
        "dllm-convert-dataset=megatron_dllm.cli.convert_dataset:main",
        "dllm-preprocess-sft=megatron_dllm.cli.preprocess_sft:main",
        "dllm-sft-lr-grid=megatron_dllm.cli.sft_lr_grid:main",
        "dllm-inspect=megatron_dllm.cli.inspect_dataset:main",
        "dllm-build-indexes=megatron_dllm.cli.build_indexes:main",
        "dllm-sample=megatron_dllm.cli.sample:main",
        "dllm-evaluate=megatron_dllm.cli.evaluate:main",
        "dllm-convert-to-hf=megatron_dllm.cli.convert_to_hf:main",
        "dllm-convert-from-hf=megatron_dllm.cli.convert_from_hf:main",
        "dllm-convert-from-ref=megatron_dllm.cli.convert_from_ref:main",
        "dllm-verify-checkpoint=megatron_dllm.cli.verify_checkpoint:main",
        "dllm-model-info=megatron_dllm.cli.model_info:main",
        "dllm-relaunch=megatron_dllm.cli.relaunch:main",
        "dllm-plan-isoflop=megatron_dllm.cli.plan_isoflop:main",
        "dllm-scaling-laws=megatron_dllm.cli.scaling_laws:main",
        "dllm-chaos-resume=megatron_dllm.cli.chaos_resume:main",
    ]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
