"""megatron_dllm: Megatron-style pretraining of discrete diffusion language models."""
from setuptools import find_packages, setup

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
        "psutil",
    ],
    extras_require={"test": ["pytest"]},
)
