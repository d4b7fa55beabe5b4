"""Selective recompute under FP8 (a GPU with TransformerEngine): with `--recompute-modules
layernorm mlp_act` the TE linears that take the released tensors (the qkv projection and the MLP's
first linear after the norms, its second after the activation) keep their inputs unquantized,
without which the release would free nothing (they would keep FP8 copies), and training takes the
same losses as without recompute."""
import pytest
import step_cases

from megatron_dllm import platform

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not platform.HAS_TE, reason="needs TransformerEngine"),
              pytest.mark.usefixtures("world_of_one")]
FP8 = ("--bf16", "--transformer-impl", "transformer_engine", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise")
RECOMPUTE = ("--recompute-activations", "--recompute-modules", "layernorm", "mlp_act")


def test_recompute_under_fp8_keeps_the_released_inputs_unquantized_and_trains_as_without():
    losses, _, _, built = step_cases.train("mdlm", 3, *FP8, *RECOMPUTE)
    for layer in built.model[0].module.layers:
        assert layer.self_attention.linear_qkv.save_original_input
        assert layer.mlp.linear_fc1.save_original_input and layer.mlp.linear_fc2.save_original_input
    assert losses == pytest.approx(step_cases.train("mdlm", 3, *FP8)[0], rel=1e-3)
