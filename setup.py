"""megatron_dllm: Megatron-style pretraining of discrete diffusion language models."""
from setuptools import find_packages, setup

try:  # pybind11 is needed at build time; without it the numpy references serve at runtime
    from pybind11.setup_helpers import Pybind11Extension, build_ext
except ImportError:  # pragma: no cover
    Pybind11Extension = build_ext = None

ext_modules, cmdclass = [], {}
if Pybind11Extension is not None:
    ext_modules.append(
        Pybind11Extension(
            "megatron_dllm._index_builders",
            ["csrc/index_builders.cpp"],
            cxx_std=17,
            # -ffp-contract=off: no FMA contraction, so the blending greedy's floating-point
            # comparisons stay bit-identical to megatron-core's helpers_cpp.
            extra_compile_args=["-O3", "-ffp-contract=off"],
            extra_link_args=["-pthread"],
            optional=True,  # a failed compile warns; megatron_dllm.data.index_builders falls back to numpy
        )
    )
    cmdclass["build_ext"] = build_ext

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
    ],
    extras_require={"test": ["pytest"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
