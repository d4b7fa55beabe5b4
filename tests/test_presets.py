"""Preset sizes reproduce the paper's table `tab:model_sizes` (vocabulary 32001)."""
import json
import os

import pytest
from conftest import REPO, launch_env, run_python

from megatron_dllm.model.builder import Architecture, check_layout
from megatron_dllm.model.params import count_parameters
from megatron_dllm.model.presets import PAPER_PRESETS, get_preset


@pytest.mark.parametrize("name", list(PAPER_PRESETS))
def test_non_embedding_params_match_the_paper(name):
    counts = count_parameters(PAPER_PRESETS[name], 32001)
    assert int(counts["non_embedding_params"] // 1e6) == int(name[:-1])  # the table truncates
    assert counts["params"] - counts["non_embedding_params"] == 32001 * PAPER_PRESETS[name].hidden_size


@pytest.mark.slow
def test_model_info_cli():
    out = run_python([os.path.join(REPO, "tools", "model_info.py"), "--preset", "1.7B", "--vocab-size", "32001",
                      "--json"], REPO, launch_env(1))
    assert out.returncode == 0, out.stderr[-2000:]
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["non_embedding_params"] == 1_708_815_873 and info["num_attention_heads"] == 17


def test_impossible_layouts_name_the_flag():
    arch = Architecture(get_preset("1708M"), 32001, 2048, "bidirectional")
    with pytest.raises(ValueError,
                       match="--tensor-model-parallel-size 2 does not divide the number of attention heads 17"):
        check_layout(arch, tp=2, pp=1, vpp=None)
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size 3"):
        check_layout(arch, tp=1, pp=3, vpp=None)
    with pytest.raises(ValueError, match="--preset '3B' is not a known preset"):
        get_preset("3B")
