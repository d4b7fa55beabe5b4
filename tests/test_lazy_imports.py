"""TorchDynamo and Inductor are imported when something compiles (`megatron_dllm/lazy_imports.py`),
in a fresh process: megatron-core's import compiles nothing, its `jit_fuser` functions still
compile on first call and equal their formula, and on a CPU TorchDynamo maps the real `torch.cuda`
functions while the CPU stand-ins stay in place for everyone else."""
import os
import subprocess
import sys

import pytest
from conftest import REPO, REPO_PYTHONPATH

CHECK = """
import sys
import torch
from megatron_dllm import platform

real_current_device = torch.cuda.current_device
platform.init_distributed(1, 1, seed=0)
import megatron.core  # every module: each jit_fuser decoration
from megatron.core.fusions.fused_bias_gelu import bias_gelu

assert "torch._inductor.compile_fx" not in sys.modules, "megatron-core's import compiled"
if not platform.HAS_CUDA:
    assert "torch._dynamo" not in sys.modules, "the CPU layer imported TorchDynamo"

y, bias = torch.randn(4, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
x = bias + y
expected = x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))  # megatron's tanh GELU
torch.testing.assert_close(bias_gelu(bias, y), expected, rtol=1e-12, atol=1e-12)
import torch._dynamo.utils
import torch._dynamo.trace_rules

assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "bias_gelu ran uncompiled"
if not platform.HAS_CUDA:
    rules = torch._dynamo.trace_rules.get_torch_obj_rule_map()
    assert real_current_device in rules and torch.cuda.current_device not in rules
    assert torch.cuda.current_device() == "cpu"  # the stand-ins are back
print("OK")
"""


@pytest.mark.slow
def test_megatron_core_compiles_only_what_runs():
    env = {**os.environ, "PYTHONPATH": REPO_PYTHONPATH, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr[-4000:]


def test_preprocessing_imports_no_torch(tmp_path, sp_model):
    """Preprocessing tokenizes text: torch is no part of it, and each of its `--workers` (spawned,
    so each imports the tool anew) would pay ~190 MB and a second to import it."""
    src = tmp_path / "a.jsonl"
    src.write_text('{"text": "To be, or not to be"}\n')
    check = ("import sys\nfrom megatron_dllm.cli.preprocess_data import main\n"
             f"assert main(['--input', {str(src)!r}, '--output-prefix', {str(tmp_path / 'o')!r}, '--tokenizer-type', "
             f"'SentencePieceTokenizer', '--tokenizer-model', {sp_model!r}]) == 0\n"
             "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
             "print('OK')")
    proc = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]
