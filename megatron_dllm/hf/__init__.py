"""Hugging Face export/import of megatron_dllm checkpoints (`tools/convert_to_hf.py`,
`tools/convert_from_hf.py`). `configuration_dllm.py` and `modeling_dllm.py` are self-contained
(torch + transformers only) and are copied into every exported directory (`auto_map`), with the
sampler files behind a diffusion model's `generate` (`remote_code.py`)."""
