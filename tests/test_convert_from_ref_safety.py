"""tools/convert_from_ref.py on hostile or broken input: a checkpoint that carries a pickle payload
(zip format, legacy torch format, plain pickle) is refused before the payload can run, naming the
file and the global; a config or weights the converter cannot use, and non-positive sizes, are one
`error:` line with exit code 2 and nothing written. A checkpoint saved in bf16 converts."""
import os
import pickle

import pytest
import torch
from test_convert_from_ref import assert_close, convert_to_hf, hf_logits, inputs, random_paper_model, save_lightning

from megatron_dllm.cli import convert_from_ref


class Payload:
    """Unpickling this runs a shell command that creates `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _legacy_save(obj, path):
    torch.save(obj, path, _use_new_zipfile_serialization=False)


def _plain_pickle(obj, path):
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)


def _error(flags, capsys, out):
    capsys.readouterr()
    assert convert_from_ref.main([*flags, "--hf-out", str(out)]) == 2, flags
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert not out.exists()  # nothing written
    return err


def _plain_pickle_checkpoint(path, payload):
    """A plain pickle (no torch framing): torch's legacy reader unpickles its first record as the
    format's magic number."""
    _plain_pickle({"hyper_parameters": {"tokenizer": payload}, "state_dict": {}}, path)
    return str(path)


@pytest.mark.parametrize("fmt", ["zip", "legacy", "pickle"])
def test_a_pickle_payload_never_runs(fmt, tmp_path, capsys):
    marker = tmp_path / "payload-ran"
    if fmt == "pickle":
        ckpt = _plain_pickle_checkpoint(tmp_path / "evil.ckpt", Payload(marker))
    else:  # a working checkpoint of the paper's DiT, plus the payload
        ckpt = save_lightning(random_paper_model("mdlm"), "mdlm", tmp_path / "evil.ckpt",
                              save=torch.save if fmt == "zip" else _legacy_save,
                              edit=lambda c: c["hyper_parameters"].update(tokenizer=Payload(marker)))
    capsys.readouterr()
    code = convert_from_ref.main(["--ref", ckpt, "--hf-out", str(tmp_path / "out")])
    assert not marker.exists()  # the payload did not run
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and not (tmp_path / "out").exists()
    assert err.startswith(f"error: --ref {ckpt}: refuses to load global '{os.system.__module__}.system'"), err


def test_torchscript_archive_is_refused_unread(tmp_path, capsys):
    path = str(tmp_path / "scripted.ckpt")
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), path)  # torch.load would hand it to torch.jit.load
    assert "a TorchScript archive, which is never loaded" in _error(["--ref", path], capsys, tmp_path / "out")


@pytest.mark.parametrize("section", ["algo", "model"])
def test_algo_or_model_that_is_not_a_mapping_is_refused(section, tmp_path, capsys):
    ckpt = save_lightning(random_paper_model("mdlm"), "mdlm", tmp_path / "last.ckpt",
                          edit=lambda c: c["hyper_parameters"]["config"].update({section: "mdlm"}))
    err = _error(["--ref", ckpt], capsys, tmp_path / "out")
    assert f"{ckpt}: config {section} is str 'mdlm', not a mapping" in err, err


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(value, tmp_path, capsys):
    model = random_paper_model("mdlm")

    def poison(ckpt):
        ckpt["state_dict"]["backbone.blocks.1.mlp.0.weight"][3, 5] = value

    ckpt = save_lightning(model, "mdlm", tmp_path / "nan.ckpt", edit=poison)
    err = _error(["--ref", ckpt], capsys, tmp_path / "out")
    assert f"{ckpt}: blocks.1.mlp.0.weight holds NaN or infinite values" in err, err


@pytest.mark.parametrize("flag,value", [("--num-attention-heads", "0"), ("--num-attention-heads", "-4"),
                                        ("--seq-length", "0"), ("--seq-length", "-1"),
                                        ("--tensor-model-parallel-size", "0"), ("--pipeline-model-parallel-size", "0"),
                                        ("--make-vocab-size-divisible-by", "0"), ("--iteration", "-1")])
def test_non_positive_sizes_are_refused_at_parse_time(flag, value, tmp_path, capsys):
    ckpt = save_lightning(random_paper_model("mdlm"), "mdlm", tmp_path / "last.ckpt")
    with pytest.raises(SystemExit) as stop:
        convert_from_ref.main(["--ref", ckpt, flag, value, "--save", str(tmp_path / "out")])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: argument {flag}: expected") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_bf16_checkpoint_converts_with_its_rounded_rotary_buffer(tmp_path):
    """Everything in bf16, the rotary buffer too (as `model.to(torch.bfloat16)` leaves it): the
    buffer is checked to bf16 precision, and the weights convert exactly."""
    model = random_paper_model("mdlm", seed=3).to(torch.bfloat16)
    ckpt = save_lightning(model, "mdlm", tmp_path / "bf16.ckpt")
    out = convert_to_hf(tmp_path, ckpt)
    fp32 = random_paper_model("mdlm", seed=3)  # the fp32 reference with the bf16 weights, exact rotary
    fp32.load_state_dict({k: v.float() for k, v in model.state_dict().items() if "inv_freq" not in k}, strict=False)
    ids, sigma, _ = inputs(11)
    with torch.no_grad():
        want = fp32(ids, sigma)
    assert_close(hf_logits(out, "mdlm", ids, sigma), want)


@pytest.mark.parametrize("edit,flags,message", [
    (lambda c: c["state_dict"].update({"backbone.blocks.0.norm1.weight": "ones"}), [],
     "state_dict entry backbone.blocks.0.norm1.weight is not a tensor"),
    (lambda c: c.update(ema={"shadow_params": 5}), ["--weights", "ema"], "ema.shadow_params is int, not a list"),
    (lambda c: c.update(ema={"shadow_params": ["w"] * 30}), ["--weights", "ema"],
     "the EMA entry for vocab_embed.embedding is not a tensor"),
], ids=["state-dict", "ema-not-a-list", "ema-entry"])
def test_entries_that_are_not_tensors_are_refused(edit, flags, message, tmp_path, capsys):
    ckpt = save_lightning(random_paper_model("mdlm"), "mdlm", tmp_path / "last.ckpt", edit=edit)
    assert message in _error(["--ref", ckpt, *flags], capsys, tmp_path / "out")
