"""Family losses against dense formulas, the noise as a pure function of the sample index, and the
package layering: families and the model import nothing from the packages built on them."""
import ast
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO

from megatron_dllm import platform
from megatron_dllm.families import Noise, get_family
from megatron_dllm.model.constants import T_EPS

VOCAB, PADDED, MASK = 50, 64, 49  # real vocabulary incl. [MASK], TP-padded size, mask id


pytestmark = pytest.mark.usefixtures("world_of_one")  # conftest


def _noise(ids, n=None, seed=3):
    ids = torch.as_tensor(ids, dtype=torch.int64)
    return Noise(seed, ids, strata=ids - ids.min(), num_strata=n or len(ids))


def _dense_nll(logits_sbv, targets_bs):
    """-log p(target) over the real vocabulary with [MASK] excluded, [b, s]."""
    logits = logits_sbv.transpose(0, 1)[..., :VOCAB].clone()
    logits[..., MASK] = float("-inf")
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets_bs.reshape(-1), reduction="none").view(targets_bs.shape)


def _on_device(loss_fn, logits, inp):
    """A family loss evaluated where the model runs (NCCL reduces device tensors only), returned on
    the CPU."""
    return loss_fn(logits.to(platform.device()), inp.to(platform.device())).cpu()


def test_ar_loss_is_cross_entropy():
    family = get_family("ar", MASK, VOCAB)
    tokens = torch.randint(0, MASK, (3, 17))
    inp = family.corrupt(tokens, _noise(range(3)))
    assert torch.equal(inp.input_ids, tokens[:, :-1]) and torch.equal(inp.targets, tokens[:, 1:])
    logits = torch.randn(16, 3, PADDED)
    expected = _dense_nll(logits, inp.targets)
    assert torch.allclose(_on_device(family.loss, logits.clone(), inp), expected, atol=1e-5)
    assert torch.allclose(_on_device(family.nelbo, logits.clone(), inp), expected, atol=1e-5)


@pytest.mark.parametrize("loss", ["low-var", "nelbo"])
def test_mdlm_losses_equal_dense_formulas(loss):
    family = get_family("mdlm", MASK, VOCAB, loss)
    tokens = torch.randint(0, MASK, (8, 64))
    inp = family.corrupt(tokens, _noise(range(8)))
    masked = inp.input_ids == MASK
    assert masked.any() and (~masked).any()
    assert torch.equal(inp.input_ids[~masked], tokens[~masked]) and torch.equal(inp.targets, tokens)
    assert torch.all(inp.sigma == 0)
    logits = torch.randn(64, 8, PADDED)
    nll = _dense_nll(logits, tokens) * masked
    low_var, nelbo = nll, nll / inp.t[:, None]  # weights 1 and dalpha/(1-alpha) = 1/t
    assert torch.allclose(_on_device(family.loss, logits.clone(), inp), low_var if loss == "low-var" else nelbo,
                          atol=1e-5)
    assert torch.allclose(_on_device(family.nelbo, logits.clone(), inp), nelbo, atol=1e-4)


def test_mask_and_padding_never_predicted():
    family = get_family("mdlm", MASK, VOCAB)
    tokens = torch.randint(0, MASK, (2, 32))
    inp = family.corrupt(tokens, _noise(range(2)))
    logits = torch.randn(32, 2, PADDED, requires_grad=True)
    _on_device(family.loss, logits.clone(), inp).sum().backward()
    assert torch.all(logits.grad[..., MASK] == 0) and torch.all(logits.grad[..., VOCAB:] == 0)


def test_unknown_loss_lists_the_valid_ones():
    from megatron_dllm.config import parse_flags, validate

    with pytest.raises(ValueError, match="--loss low-var is not available for --family ar; valid: nll"):
        validate(parse_flags(["--family", "ar", "--loss", "low-var"]))
    with pytest.raises(ValueError, match="--family 'sedd' is not a known family"):
        get_family("sedd", MASK, VOCAB)


def test_t_is_stratified_over_the_global_batch():
    n = 64
    t = _noise(range(1000, 1000 + n)).t()
    strata = ((t - T_EPS) / (1 - T_EPS) * n).floor().long()
    assert sorted(strata.tolist()) == list(range(n))
    assert t.min() >= T_EPS and t.max() <= 1


def test_noise_depends_only_on_the_sample():
    """Splitting a global batch over DP ranks / micro-batches changes nothing for a sample."""
    family = get_family("mdlm", MASK, VOCAB)
    tokens = torch.randint(0, MASK, (8, 128))
    whole = family.corrupt(tokens, _noise(range(100, 108), n=8))
    ids = torch.arange(100, 108)
    for part in (slice(0, 2), slice(2, 6), slice(6, 8)):
        noise = Noise(3, ids[part], strata=ids[part] - 100, num_strata=8)
        piece = family.corrupt(tokens[part], noise)
        assert torch.equal(piece.input_ids, whole.input_ids[part]) and torch.equal(piece.t, whole.t[part])


def test_mask_rate_follows_the_schedule():
    family = get_family("mdlm", MASK, VOCAB)
    inp = family.corrupt(torch.zeros(64, 4096, dtype=torch.long), _noise(range(64)))
    rate = (inp.input_ids == MASK).float().mean(1)
    assert torch.allclose(rate, (1 - T_EPS) * inp.t, atol=0.03)


@pytest.mark.slow
def test_noise_is_the_same_after_a_restart():
    code = ("import torch; from megatron_dllm.families import Noise, get_family;"
            "ids = torch.arange(5, 9);"
            "inp = get_family('mdlm', 49, 50).corrupt(torch.arange(4 * 40).view(4, 40) % 49, "
            "Noise(3, ids, ids - 5, 4));"
            "print(inp.input_ids.tolist(), inp.t.tolist())")
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    ids = torch.arange(5, 9)
    inp = get_family("mdlm", 49, 50).corrupt(torch.arange(4 * 40).view(4, 40) % 49, Noise(3, ids, ids - 5, 4))
    assert fresh.strip() == f"{inp.input_ids.tolist()} {inp.t.tolist()}"


# The megatron_dllm modules each package may import: families and the model sit below sampling,
# evaluation, the HF export, training, scaling and data.
# errors (the bad-input exception type), seeding and platform sit below every layer
LAYERS = {"families": {"families", "model", "platform", "errors", "seeding", "_esolm_shuffle",
                       "_esolm_shuffle_cuda"},
          "model": {"model", "platform", "errors"}}
PACKAGE_ROOT = pathlib.Path(REPO) / "megatron_dllm"


def _internal_imports(path: pathlib.Path) -> set[str]:
    """The megatron_dllm modules (first name below the package) a file imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # sampling/'s files import their siblings relatively (sampling/deps.py)
                assert node.level == 1 and path.parent.name == "sampling", f"{path}: relative import"
                found.add("sampling")
                continue
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(n.split(".")[1] for n in names if n.startswith("megatron_dllm."))
    return found


def test_layers_import_nothing_above_them():
    for package, allowed in LAYERS.items():
        for path in sorted((PACKAGE_ROOT / package).glob("*.py")):
            assert _internal_imports(path) <= allowed, f"{path.name} imports {_internal_imports(path) - allowed}"
    for path in sorted((PACKAGE_ROOT / "sampling").glob("*.py")):
        assert "training" not in _internal_imports(path), path.name
