"""tools/install_gpu_offline.sh, as far as a CPU allows: real pip, no index, into fresh venvs.

The wheelhouse holds stand-ins named and versioned like the real artifacts, with their real
declared requirements (megatron-core's come from its installed metadata, the pydantic chain's from
theirs): TE's core and meta wheels, a `transformer_engine_torch` sdist whose setup.py records how
it was built, and megatron-core with a `HAVE_TE` module. setuptools, packaging and wheel (the copy
setuptools carries) are repacked from this interpreter's real installs: the build and the check
run them. The venv's torch is a
stand-in whose `torch.version.cuda` comes from STANDIN_TORCH_CUDA, so the CUDA checks run on a CPU;
the compile itself and the real TE import need a GPU node (docs/gpu.md)."""
from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tools" / "install_gpu_offline.sh"
DOWNLOAD = REPO / "tools" / "download_gpu_wheelhouse.sh"
PINS = dict(line.split("==") for line in (REPO / "constraints.txt").read_text().splitlines()
            if "==" in line and not line.startswith("#"))
PINS = {k.lower().replace("_", "-"): v for k, v in PINS.items()}
TE, TE_NEW = "2.11.0", "2.20.2"
# this project's requirements already in the node's image; psutil is left to the wheelhouse
PREINSTALLED = ["numpy", "sentencepiece", "tensorboard", "pybind11", "tokenizers", "tiktoken", "zstandard",
                "pyarrow", "scipy", "matplotlib"]


def make_wheel(dest: Path, name: str, version: str, files: dict | None = None, requires=(),
               tag: str = "py3-none-any", extras=()) -> Path:
    dist = f"{name.replace('-', '_')}-{version}"
    info = f"{dist}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Provides-Extra: {e}\n" for e in extras)
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    entries = {**(files or {}), f"{info}/METADATA": meta,
               f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n"}
    return _zip_wheel(dest / f"{dist}-{tag}.whl", info, {k: v.encode() if isinstance(v, str) else v
                                                          for k, v in entries.items()})


def _zip_wheel(path: Path, info: str, entries: dict) -> Path:
    record = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        for arc, data in entries.items():
            z.writestr(arc, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{arc},sha256={digest},{len(data)}")
        z.writestr(f"{info}/RECORD", "\n".join(record + [f"{info}/RECORD,,"]) + "\n")
    return path


def repack_installed(dest: Path, name: str) -> Path:
    """A wheel of a pure-Python distribution installed in this interpreter (there is no index)."""
    dist = md.distribution(name)
    entries = {}
    for f in dist.files:
        s = str(f)
        if s.startswith("..") or "__pycache__" in s or s.endswith(("/RECORD", "/INSTALLER", "/REQUESTED",
                                                                     "/direct_url.json")):
            continue
        entries[s] = Path(dist.locate_file(f)).read_bytes()
    info = next(s for s in entries if s.endswith(".dist-info/METADATA")).split("/")[0]
    version = dist.version
    return _zip_wheel(dest / f"{dist.metadata['Name'].replace('-', '_')}-{version}-py3-none-any.whl", info, entries)


def standin_like_installed(dest: Path, name: str) -> Path:
    """A code-free wheel with the installed distribution's name, version and requirements."""
    return make_wheel(dest, md.distribution(name).metadata["Name"], md.version(name), requires=md.requires(name) or ())


SDIST_SETUP = '''\
import json, os, sys
import setuptools
from wheel.bdist_wheel import bdist_wheel as _bdist_wheel  # as TE's setup.py
import torch

class Recorded(_bdist_wheel):
    def run(self):
        if os.environ.get("NVTE_PYTORCH_FORCE_BUILD", "FALSE") != "TRUE":
            sys.exit("stand-in: without NVTE_PYTORCH_FORCE_BUILD=TRUE TE's setup.py downloads a prebuilt wheel")
        record = {k: os.environ.get(k) for k in ("NVTE_PYTORCH_FORCE_BUILD", "NVTE_NO_LOCAL_VERSION", "MAX_JOBS",
                                                 "CPATH")}
        record.update(torch=torch.__file__, cuda=torch.version.cuda,
                      isolated=any("pip-build-env" in p for p in sys.path))
        with open(os.environ["STANDIN_BUILD_LOG"], "a") as f:
            f.write(json.dumps(record) + "\\n")
        super().run()

cuda_major = int(torch.version.cuda.split(".")[0])
setuptools.setup(name="transformer_engine_torch", version="@V@", py_modules=["transformer_engine_torch"],
                 install_requires=[*@REQUIRES@, f"transformer_engine_cu{cuda_major}==@V@"],
                 cmdclass={"bdist_wheel": Recorded})
'''


# what TE 2.11.0's binding declares besides its core wheel; `import transformer_engine.pytorch`
# imports onnx and onnxscript
BINDING_REQUIRES = ["torch>=2.1", "einops", "onnxscript", "onnx", "packaging", "pydantic"]


def make_sdist(dest: Path, version: str) -> Path:
    top = f"transformer_engine_torch-{version}"
    requires = [*BINDING_REQUIRES, f"transformer_engine_cu12=={version}"]  # as packaged: cu12, whatever the node
    files = {
        "PKG-INFO": f"Metadata-Version: 2.1\nName: transformer_engine_torch\nVersion: {version}\n"
                    + "".join(f"Requires-Dist: {r}\n" for r in requires),
        # TE's own build-system table
        "pyproject.toml": '[build-system]\nrequires = ["setuptools>=61.0", "pip", "torch>=2.1"]\n'
                          'build-backend = "setuptools.build_meta:__legacy__"\n',
        "setup.py": SDIST_SETUP.replace("@V@", version).replace("@REQUIRES@", repr(BINDING_REQUIRES)),
        "transformer_engine_torch.py": "BUILT = True  # the compiled binding on a GPU node\n",
    }
    path = dest / f"{top}.tar.gz"
    with tarfile.open(path, "w:gz") as t:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return path


def make_te(dest: Path, version: str, cuda_major: int = 13) -> None:
    core_requires = ["pydantic", "importlib-metadata>=1.0", "packaging"]  # TE's core wheel declares these
    make_wheel(dest, f"transformer_engine_cu{cuda_major}", version, tag="py3-none-manylinux_2_28_x86_64",
               requires=core_requires, files={
                   "transformer_engine/common/__init__.py": "",
                   "transformer_engine/pytorch/__init__.py": "import transformer_engine_torch  # noqa: F401\n",
                   "transformer_engine/pytorch/fp8.py": "class FP8GlobalStateManager: ...\n"
                                                        "def fp8_autocast(): ...\n"})
    make_wheel(dest, "transformer_engine", version, extras=("core_cu12", "core_cu13", "pytorch"), requires=[
        f'transformer_engine_cu12=={version}; extra == "core_cu12"',
        f'transformer_engine_cu13=={version}; extra == "core_cu13"',
        f'transformer_engine_torch=={version}; extra == "pytorch"'], files={
        "transformer_engine/__init__.py": "from importlib import metadata\n"
                                          "__version__ = str(metadata.version('transformer_engine'))\n"})
    make_sdist(dest, version)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """pre/: what the node's image already has; wh/: a complete wheelhouse (TE 2.11.0); te_new/:
    TE 2.20.2's three artifacts."""
    base = tmp_path_factory.mktemp("artifacts")
    pre, wh, te_new = base / "pre", base / "wh", base / "te_new"
    for d in (pre, wh, te_new):
        d.mkdir()
    make_wheel(pre, "torch", "2.13.0+cu130", files={
        "torch/__init__.py": "from . import version\n__version__ = version.__version__\n",
        "torch/version.py": "import os\n__version__ = '2.13.0+cu130'\n"
                            "cuda = os.environ.get('STANDIN_TORCH_CUDA', '13.0') or None\n"})
    make_wheel(pre, "nvidia-cudnn-cu13", "9.13.0.50", files={"nvidia/cudnn/include/cudnn.h": "",
                                                              "nvidia/cudnn/__init__.py": ""})
    for name in PREINSTALLED:
        make_wheel(pre, name, PINS[name])
    for name, version in (("einops", "0.8.1"), ("onnx", "1.23.1")):  # in the GPU image, not in constraints.txt
        make_wheel(pre, name, version)

    mc = md.distribution("megatron-core")
    make_wheel(wh, "megatron_core", mc.version, requires=mc.requires, extras=mc.metadata.get_all("Provides-Extra"),
               files={"megatron/__init__.py": "", "megatron/core/__init__.py": "",
                      "megatron/core/package_info.py": f"__version__ = '{mc.version}'\n",
                      "megatron/core/extensions/__init__.py": "",
                      # the import megatron-core 0.16.1 makes to set HAVE_TE
                      "megatron/core/extensions/transformer_engine.py":
                          "try:\n    import transformer_engine as te  # noqa: F401\n"
                          "    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager, fp8_autocast  # noqa\n"
                          "    HAVE_TE = True\nexcept ImportError:\n    HAVE_TE = False\n"})
    make_te(wh, TE)
    make_te(te_new, TE_NEW)
    for name in ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions"):
        standin_like_installed(wh, name)
    make_wheel(wh, "importlib_metadata", "8.7.0", requires=["zipp>=3.20"])
    make_wheel(wh, "zipp", "3.23.0")
    make_wheel(wh, "onnxscript", "0.7.2", requires=["onnx>=1.16"])  # a node without it: from the wheelhouse
    make_wheel(wh, "psutil", PINS["psutil"])
    make_wheel(wh, "psutil", "99.0")  # newer than the pin: the pin must win
    # the build tools a bare Python 3.12 venv lacks (wheel: the copy setuptools carries)
    repack_installed(wh, "setuptools")
    vendor = Path(md.distribution("setuptools").locate_file("setuptools")) / "_vendor"
    info = next(vendor.glob("wheel-*.dist-info"))
    _zip_wheel(wh / f"{info.name[:-len('.dist-info')]}-py3-none-any.whl", info.name, {
        str(f.relative_to(vendor)): f.read_bytes() for d in (vendor / "wheel", info) for f in d.rglob("*")
        if f.is_file() and "__pycache__" not in f.parts and f.name not in ("RECORD", "INSTALLER", "REQUESTED")})
    repack_installed(wh, "packaging")
    return {"pre": pre, "wh": wh, "te_new": te_new}


def env_for(venv: Path, log: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON", "MAX_JOBS", "DLLM_"))}
    # no pip configuration of this machine (its constraints, its find-links) and no cache
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_CACHE_DIR="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
               PYTHON=str(venv / "bin" / "python"), STANDIN_BUILD_LOG=str(log), **extra)
    return env


def make_venv(path: Path, pre: Path) -> Path:
    """A node's environment: a stand-in CUDA torch, torch's cuDNN package and some of this
    project's requirements; like a Python 3.12 venv, no setuptools. Its pip is this interpreter's,
    reached through a .pth file holding only pip (ensurepip takes 5 to 25 s a venv)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    only_pip = path / "only_pip"
    only_pip.mkdir()
    (only_pip / "pip").symlink_to(Path(md.distribution("pip").locate_file("pip")))
    site = next((path / "lib").glob("python3*/site-packages"))
    (site / "runner_pip.pth").write_text(f"{only_pip}\n")
    py = str(path / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", *map(str, pre.glob("*.whl"))],
                   check=True, env=env_for(path, path / "unused"))
    return path


def freeze(venv: Path) -> str:
    return subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "freeze", "--all"], capture_output=True,
                          text=True, check=True, env=env_for(venv, venv / "unused")).stdout


def run_script(venv: Path, wh: Path, log: Path, **extra):
    return subprocess.run(["bash", str(SCRIPT), str(wh)], capture_output=True, text=True, timeout=300,
                          env=env_for(venv, log, **extra))


def listing(d: Path) -> dict:
    return {f.name: f.stat().st_mtime_ns for f in d.iterdir()}


@pytest.fixture(scope="module")
def node(parts, tmp_path_factory):
    """One venv for the refusals: each must leave it exactly as it was."""
    return make_venv(tmp_path_factory.mktemp("node") / "venv", parts["pre"])


def copy_wh(parts, dest: Path, drop=(), add=()) -> Path:
    dest.mkdir()
    for f in [f for f in parts["wh"].iterdir() if not f.name.startswith(tuple(drop))] + list(add):
        shutil.copy2(f, dest / f.name)
    return dest


def check_refused(node, wh, log, expected_lines, **extra):
    before, files = freeze(node), listing(wh)
    r = run_script(node, wh, log, **extra)
    assert r.returncode != 0, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == len(expected_lines), r.stderr
    for line, parts in zip(lines, expected_lines):
        assert all(part in line for part in parts), (line, parts)
    assert freeze(node) == before and listing(wh) == files and not log.exists()  # nothing installed or built
    return r


@pytest.mark.slow  # venvs and pip runs
def test_missing_artifacts_each_named_before_anything_installs(parts, node, tmp_path):
    # torch built for CUDA 12 and a wheelhouse with TE for CUDA 13 only
    wh = copy_wh(parts, tmp_path / "wh12")
    check_refused(node, wh, tmp_path / "log", [
        ("error: 1 problem(s)", str(wh), "nothing was installed"),
        (f"transformer_engine_cu12-{TE}-", "TE's core wheel for torch's CUDA 12", str(wh))],
        STANDIN_TORCH_CUDA="12.8")
    # three artifacts absent: each on its own line, pydantic-core's named with who needs it
    wh = copy_wh(parts, tmp_path / "wh13", drop=("megatron_core", "pydantic_core", "transformer_engine_torch"))
    check_refused(node, wh, tmp_path / "log", [
        ("error: 3 problem(s)",),
        ("missing or refused: megatron-core", "==0.16.1", "needed by megatron_dllm (setup.py)", "no wheel"),
        (f"missing or refused: transformer_engine_torch-{TE}.tar.gz", "sdist"),
        (f"missing or refused: pydantic-core=={PINS['pydantic-core']}", "needed by pydantic 2.14.3", "no wheel")])


@pytest.mark.slow  # venvs and pip runs
def test_the_bindings_import_requirements_are_needed(parts, node, tmp_path):
    """`import transformer_engine.pytorch` imports onnxscript: a node without it, and a wheelhouse
    without it, are refused before the build rather than after it."""
    wh = copy_wh(parts, tmp_path / "wh", drop=("onnxscript",))
    check_refused(node, wh, tmp_path / "log", [
        ("error: 1 problem(s)",),
        ("missing or refused: onnxscript (needed by transformer_engine_torch 2.11.0): no wheel for this Python",)])


@pytest.mark.slow  # venvs and pip runs
def test_cpu_torch_is_refused_with_one_line(parts, node, tmp_path):
    wh = copy_wh(parts, tmp_path / "wh")
    check_refused(node, wh, tmp_path / "log", [
        ("error: torch 2.13.0+cu130 in", "is a CPU build (torch.version.cuda is None)", "needs a CUDA build")],
        STANDIN_TORCH_CUDA="")


@pytest.mark.slow  # venvs and pip runs
def test_te_outside_megatron_core_range_is_refused(parts, node, tmp_path):
    wh = copy_wh(parts, tmp_path / "wh", drop=("transformer_engine",), add=parts["te_new"].iterdir())
    check_refused(node, wh, tmp_path / "log", [
        ("error: 1 problem(s)",),
        (f"TransformerEngine {TE_NEW}", "outside megatron-core 0.16.1's supported range <2.12.0,>=2.9.0a0",
         "DLLM_ALLOW_ANY_TE=1")])


@pytest.mark.slow  # venvs and pip runs
def test_corrupt_transfer_is_named(parts, node, tmp_path):
    wh = copy_wh(parts, tmp_path / "wh")
    core = next(wh.glob("transformer_engine_cu13-*.whl"))
    sums = subprocess.run(["sha256sum", core.name], cwd=wh, capture_output=True, text=True, check=True).stdout
    (wh / "SHA256SUMS").write_text(sums)
    with open(core, "r+b") as f:  # a transfer cut short
        f.truncate(core.stat().st_size - 1)
    check_refused(node, wh, tmp_path / "log", [
        ("error: 2 problem(s)",), (str(core), "sha256 differs from", "SHA256SUMS"),
        ("transformer_engine_cu13", "core wheel")])


@pytest.mark.slow  # venvs and pip runs
def test_install_builds_the_binding_once_and_the_next_node_reuses_it(parts, tmp_path):
    # TE 2.20.2 beside 2.11.0: the newest inside megatron-core's range is chosen
    # (a space in the wheelhouse's path)
    wh, log = copy_wh(parts, tmp_path / "wheel house", add=parts["te_new"].iterdir()), tmp_path / "build.log"
    nproc = subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout.strip()
    first = make_venv(tmp_path / "node1", parts["pre"])
    r = run_script(first, wh, log)
    assert r.returncode == 0, r.stdout + r.stderr
    builds = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(builds) == 1, builds
    site = next((first / "lib").glob("python3*/site-packages"))
    assert builds[0] == {"NVTE_PYTORCH_FORCE_BUILD": "TRUE", "NVTE_NO_LOCAL_VERSION": "1", "MAX_JOBS": nproc,
                         "CPATH": str(site / "nvidia" / "cudnn" / "include"),
                         "torch": str(site / "torch" / "__init__.py"), "cuda": "13.0", "isolated": False}
    kept = wh / f"transformer_engine_torch-{TE}-py3-none-any.whl"
    assert kept.is_file()
    assert r.stdout.strip().splitlines()[-1] == (f"torch 2.13.0+cu130 (CUDA 13.0), transformer_engine {TE}, "
                                                 "megatron-core 0.16.1, HAVE_TE True")
    versions = json.loads(subprocess.run(
        [str(first / "bin" / "python"), "-c", "import importlib.metadata as md, json; print(json.dumps("
         "{d.metadata['Name'].lower().replace('_', '-'): d.version for d in md.distributions()}))"],
        capture_output=True, text=True, check=True).stdout)
    assert versions["psutil"] == PINS["psutil"]  # constraints.txt's pin, not the newest wheel
    assert versions["numpy"] == PINS["numpy"] and versions["torch"] == "2.13.0+cu130"  # the image's, untouched
    for name in ("megatron-core", "transformer-engine", "transformer-engine-cu13", "transformer-engine-torch"):
        assert versions[name] == ("0.16.1" if name == "megatron-core" else TE), name
    for name in ("pydantic", "pydantic-core", "typing-extensions", "packaging", "setuptools"):
        assert versions[name] == PINS[name], name
    assert "wheel" in versions and "importlib-metadata" in versions
    assert versions["onnxscript"] == "0.7.2" and versions["onnx"] == "1.23.1"  # the binding's, the image's onnx

    # the next node gets the wheelhouse with the built wheel in it: no build
    kept_mtime = kept.stat().st_mtime_ns
    second = make_venv(tmp_path / "node2", parts["pre"])
    r = run_script(second, wh, log, MAX_JOBS="3")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"using the binding built before: {kept.name} (no build)" in r.stdout
    assert len(log.read_text().splitlines()) == 1 and kept.stat().st_mtime_ns == kept_mtime
    assert r.stdout.strip().splitlines()[-1].endswith("HAVE_TE True")


@pytest.mark.slow  # venvs and pip runs
def test_override_installs_a_newer_te_with_a_warning(parts, tmp_path):
    wh = copy_wh(parts, tmp_path / "wh", add=parts["te_new"].iterdir())
    venv, log = make_venv(tmp_path / "node", parts["pre"]), tmp_path / "build.log"
    r = run_script(venv, wh, log, DLLM_ALLOW_ANY_TE="1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"warning: TransformerEngine {TE_NEW} in {wh} is outside megatron-core 0.16.1's supported range" in r.stderr
    assert f"transformer_engine {TE_NEW}, megatron-core 0.16.1, HAVE_TE True" in r.stdout
    assert len(log.read_text().splitlines()) == 1


@pytest.mark.parametrize("args,expected", [
    ([], "usage: tools/install_gpu_offline.sh WHEELHOUSE (a directory of wheels; see docs/gpu.md)"),
    (["/nonexistent/wh"], "error: WHEELHOUSE /nonexistent/wh: not a directory"),
])
def test_install_bad_arguments(args, expected, tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [expected]


def test_install_without_torch_or_pip_is_one_line(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (tmp_path / "wh").mkdir()
    r = run_script(venv, tmp_path / "wh", tmp_path / "log")
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"error: {venv / 'bin' / 'python'} has no torch: install a CUDA build of torch first "
        "(this script never installs torch)"]
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text("__version__ = '2.13.0+cu130'\nclass version:\n    cuda = '13.0'\n")
    r = run_script(venv, tmp_path / "wh", tmp_path / "log")
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"error: {venv / 'bin' / 'python'} has no pip: install pip (python -m ensurepip) first"]


@pytest.mark.parametrize("args,expected", [
    (["wh"], "usage: tools/download_gpu_wheelhouse.sh DIR cu12|cu13 [TE_VERSION]"),
    (["wh", "cu11"], "error: CUDA choice cu11: expected cu12 or cu13 (the CUDA major of the node's torch)"),
    (["wh", "cu13", "latest"], "error: TE_VERSION latest: expected a release such as 2.11.0"),
])
def test_download_bad_arguments_touch_nothing(args, expected, tmp_path):
    r = subprocess.run(["bash", str(DOWNLOAD), *args], capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [expected] and not (tmp_path / "wh").exists()
