#!/usr/bin/env bash
# Install megatron-core, TransformerEngine (core wheel, meta wheel, PyTorch binding built from its
# sdist) and this project's missing runtime dependencies from a local directory of wheels, with no
# package index: for GPU nodes without registry access. See docs/gpu.md, "Installing on an
# air-gapped GPU node".
#
#   tools/install_gpu_offline.sh WHEELHOUSE
#
# Environment:
#   PYTHON               the interpreter to install into (default: python); it must already hold a
#                        CUDA build of torch, which this script never installs or replaces
#   MAX_JOBS             parallel compile jobs for the binding (default: nproc)
#   DLLM_ALLOW_ANY_TE=1  install a TE version outside the range megatron-core declares (to try a
#                        newer TE; unsupported)
#
# Everything is checked before anything is installed: each missing artifact is named on its own
# line. The binding is built once with `pip wheel` into WHEELHOUSE, so a node that gets the same
# wheelhouse afterwards installs that wheel and skips the build.
set -euo pipefail

if [[ $# -ne 1 || "$1" == -* ]]; then
  echo "usage: tools/install_gpu_offline.sh WHEELHOUSE (a directory of wheels; see docs/gpu.md)" >&2
  exit 2
fi
WH=$1
if [[ ! -d "$WH" ]]; then
  echo "error: WHEELHOUSE $WH: not a directory" >&2
  exit 2
fi
WH=$(cd "$WH" && pwd)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python}
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "error: PYTHON=$PY: no such interpreter" >&2
  exit 2
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# The check and the plan: runs in the target interpreter, so installed distributions, wheel tags
# and environment markers are the node's own. Writes $WORK/plan.sh on success.
"$PY" - "$WH" "$ROOT" "$WORK" <<'PY'
import ast
import hashlib
import importlib.metadata as md
import os
import re
import shlex
import sys
import tarfile
import zipfile
from pathlib import Path

wh, root, work = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
problems = []  # one line each, all printed before exiting


def fail(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(1)


# torch: must be present and a CUDA build (TE's binding parses torch.version.cuda)
try:
    import torch
except ImportError:
    fail(f"{sys.executable} has no torch: install a CUDA build of torch first (this script never installs torch)")
if not getattr(torch.version, "cuda", None):
    fail(f"torch {torch.__version__} in {sys.executable} is a CPU build (torch.version.cuda is None); "
         "TransformerEngine's PyTorch binding needs a CUDA build of torch")
cuda_major = int(str(torch.version.cuda).split(".")[0])
if cuda_major not in (12, 13):
    fail(f"torch {torch.__version__} is built for CUDA {torch.version.cuda}; TransformerEngine has wheels for CUDA 12 and 13")

try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.tags import sys_tags
    from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename
    from packaging.version import Version
except ImportError:  # a bare venv: pip carries its own copy
    try:
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.specifiers import SpecifierSet
        from pip._vendor.packaging.tags import sys_tags
        from pip._vendor.packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename
        from pip._vendor.packaging.version import Version
    except ImportError:
        fail(f"{sys.executable} has no pip: install pip (python -m ensurepip) first")

# Transfers split to pass a size limit leave a SHA256SUMS to check the reassembled files against
sums = wh / "SHA256SUMS"
corrupt = set()  # left out of the wheelhouse, so what needs them is named as missing too
if sums.is_file():
    for line in sums.read_text().splitlines():
        if not line.strip():
            continue
        digest, _, name = line.strip().partition("  ")
        f = wh / name.lstrip("*")
        if not f.is_file():
            problems.append(f"{f}: listed in {sums} but absent (pieces not joined with cat?)")
            continue
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        if h.hexdigest() != digest:
            corrupt.add(f.name)
            problems.append(f"{f}: sha256 differs from {sums} (a truncated or corrupted transfer)")

# The wheelhouse: compatible wheels by name and version, and sdists
tags = set(sys_tags())
wheels, sdists = {}, {}
for f in sorted(wh.iterdir()):
    if f.name in corrupt:
        continue
    try:
        if f.name.endswith(".whl"):
            name, ver, _, wtags = parse_wheel_filename(f.name)
            if wtags & tags:
                wheels.setdefault(name, {})[ver] = f
        elif f.name.endswith(".tar.gz"):
            name, ver = parse_sdist_filename(f.name)
            sdists.setdefault(name, {})[ver] = f
    except Exception:
        continue  # not a distribution (SHA256SUMS, notes, split pieces)

pins = {}
for line in (root / "constraints.txt").read_text().splitlines():
    line = line.split("#")[0].strip()
    if line:
        r = Requirement(line)
        pins[canonicalize_name(r.name)] = r.specifier


def installed(name):
    try:
        return Version(md.version(name))
    except md.PackageNotFoundError:
        return None


def requires_dist(text):
    return [v.strip() for k, v in (ln.split(":", 1) for ln in text.splitlines() if ":" in ln)
            if k == "Requires-Dist"]


def wheel_requires(path):
    try:
        with zipfile.ZipFile(path) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
            text = z.read(meta).decode("utf-8")
    except (OSError, zipfile.BadZipFile, StopIteration, UnicodeDecodeError) as e:
        problems.append(f"{path}: not a readable wheel ({type(e).__name__}: {e})")
        return []
    return requires_dist(text)


def sdist_member(path, name):
    """The text of NAME at the sdist's top level ("" if absent)."""
    with tarfile.open(path) as t:
        top = t.getnames()[0].split("/")[0]
        try:
            return t.extractfile(f"{top}/{name}").read().decode("utf-8")
        except KeyError:
            return ""


picked = {}  # name -> (version, wheel path): what pip is told to install from the wheelhouse
absent = set()


def need(req, why, with_deps=True):
    """Satisfied by the installed distribution, or by one wheel in the wheelhouse (the pinned
    version from constraints.txt where it pins one), whose own requirements are followed."""
    r = Requirement(req) if isinstance(req, str) else req
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        return
    name = canonicalize_name(r.name)
    if name == "torch":
        return  # checked above; never replaced
    have = installed(name)
    if name in picked:
        if picked[name][0] not in r.specifier:
            problems.append(f"{r} (needed by {why}): the wheelhouse's {name} {picked[name][0]} does not satisfy it")
        return
    if have is not None and r.specifier.contains(have, prereleases=True):
        return
    spec = r.specifier & pins.get(name, SpecifierSet())
    ok = [v for v in wheels.get(name, {}) if spec.contains(v, prereleases=True)]
    if not ok:
        if name not in absent:  # named once, for whoever needs it first
            absent.add(name)
            what = f"{name}{spec}" if str(spec) else name
            problems.append(f"{what} (needed by {why}): no wheel for this Python and platform in {wh}")
        return
    v = max(ok)
    picked[name] = (v, wheels[name][v])
    if with_deps:
        for dep in wheel_requires(wheels[name][v]):
            need(dep, f"{name} {v}")


# This project's runtime requirements, as setup.py lists them
tree = ast.parse((root / "setup.py").read_text())
project_reqs = next(ast.literal_eval(kw.value) for node in ast.walk(tree) if isinstance(node, ast.Call)
                    for kw in node.keywords if kw.arg == "install_requires")
for req in project_reqs:
    need(req, "megatron_dllm (setup.py)")

# megatron-core, and the TE range it declares (its `dev` extra pins the TE it is tested with)
need("megatron-core", "megatron_dllm")
mc = picked.get("megatron-core", (installed("megatron-core"), None))
te_range = None
if mc[0] is not None:
    reqs = wheel_requires(mc[1]) if mc[1] else (md.requires("megatron-core") or [])
    for line in reqs:
        r = Requirement(line)
        if canonicalize_name(r.name) == "transformer-engine" and r.marker is not None \
                and r.marker.evaluate({"extra": "dev"}) and not r.marker.evaluate({"extra": ""}):
            te_range = r.specifier
# TransformerEngine: core wheel for torch's CUDA major, meta wheel, binding (built wheel or sdist),
# all of one version: the newest core wheel inside megatron-core's range (the newest of all with
# DLLM_ALLOW_ANY_TE=1)
allow_any = os.environ.get("DLLM_ALLOW_ANY_TE") == "1"
core = f"transformer-engine-cu{cuda_major}"
te_versions = (wheels.get(core) or wheels.get("transformer-engine") or sdists.get("transformer-engine-torch") or {})
in_range = [v for v in te_versions if te_range is None or te_range.contains(v, prereleases=True)]
te = max(in_range) if in_range and not allow_any else (max(te_versions) if te_versions else None)
label = te if te is not None else "<version>"
if te is None or te not in wheels.get(core, {}):
    problems.append(f"transformer_engine_cu{cuda_major}-{label}-py3-none-manylinux_2_28_<arch>.whl "
                    f"(TE's core wheel for torch's CUDA {cuda_major}): not in {wh}")
if te is None or te not in wheels.get("transformer-engine", {}):
    problems.append(f"transformer_engine-{label}-py3-none-any.whl (TE's meta wheel; "
                    f"transformer_engine reads its version from it): not in {wh}")
built = wheels.get("transformer-engine-torch", {}).get(te)
sdist = sdists.get("transformer-engine-torch", {}).get(te)
if te is None or (built is None and sdist is None):
    problems.append(f"transformer_engine_torch-{label}.tar.gz (the PyTorch binding's sdist, built here): not in {wh}")
if te is not None:
    if te in wheels.get(core, {}):
        need(f"{core}=={te}", "TransformerEngine")
    if te in wheels.get("transformer-engine", {}):
        need(f"transformer-engine=={te}", "TransformerEngine", with_deps=False)  # its deps are extras
# The binding's own requirements are needed at import: `import transformer_engine.pytorch` imports
# onnx and onnxscript (TE 2.11). Its pin of a TE core wheel is left out: the sdist names the CUDA
# major it was packaged for (cu12), and the core wheel for torch's is needed above.
if built is not None or sdist is not None:
    for req in wheel_requires(built) if built is not None else requires_dist(sdist_member(sdist, "PKG-INFO")):
        if not canonicalize_name(Requirement(req).name).startswith("transformer-engine"):
            need(req, f"transformer_engine_torch {te}")

if te is not None and mc[0] is not None:
    if te_range is None:
        problems.append(f"megatron-core {mc[0]} declares no transformer-engine range (its `dev` extra)")
    elif not te_range.contains(te, prereleases=True):
        msg = (f"TransformerEngine {te} in {wh} is outside megatron-core {mc[0]}'s supported range "
               f"{te_range}")
        if allow_any:
            print(f"warning: {msg}; installing it anyway (DLLM_ALLOW_ANY_TE=1)", file=sys.stderr)
        else:
            problems.append(f"{msg}; set DLLM_ALLOW_ANY_TE=1 to install it anyway")

# Building the binding without isolation needs its build requirements in this interpreter
if built is None and sdist is not None:
    pyproject, setup_py = sdist_member(sdist, "pyproject.toml"), sdist_member(sdist, "setup.py")
    m = re.search(r"^requires\s*=\s*(\[.*?\])", pyproject, re.M | re.S)
    build_reqs = ast.literal_eval(m.group(1)) if m else ["setuptools"]
    if re.search(r"^\s*(from|import) wheel\b", setup_py, re.M):
        build_reqs.append("wheel")  # TE's setup.py imports wheel.bdist_wheel
    for req in build_reqs:
        if canonicalize_name(Requirement(req).name) != "pip":
            need(req, f"building {sdist.name}")
    if not os.access(wh, os.W_OK):
        problems.append(f"{wh}: not writable, and the built binding wheel is kept there")

if problems:
    print(f"error: {len(problems)} problem(s) with {wh}; nothing was installed:", file=sys.stderr)
    for p in problems:
        print(f"  missing or refused: {p}", file=sys.stderr)
    sys.exit(1)

q = shlex.quote  # paths may hold spaces
with open(work / "plan.sh", "w") as out:
    out.write(f"TE_VERSION={q(str(te))}\nCUDA_MAJOR={cuda_major}\n")
    out.write(f"BUILT_WHEEL={q(str(built or ''))}\nSDIST={q(str(sdist or ''))}\n")
    out.write("REQS=(" + " ".join(q(f"{n}=={v}") for n, (v, _) in sorted(picked.items())) + ")\n")
PY
# shellcheck disable=SC1091
source "$WORK/plan.sh"
PIP=("$PY" -m pip install --no-index --find-links "$WH")

echo "TransformerEngine $TE_VERSION for CUDA $CUDA_MAJOR; installing ${#REQS[@]} distribution(s) from $WH"
if [[ ${#REQS[@]} -gt 0 ]]; then
  "${PIP[@]}" "${REQS[@]}"
fi

if [[ -z "$BUILT_WHEEL" ]]; then
  # FORCE_BUILD: without it the binding's setup.py tries to download a prebuilt wheel. No build
  # isolation: it must compile against the installed CUDA torch. The cuDNN and NCCL headers come
  # from torch's nvidia pip packages (CPATH; NVTE_BUILD_USE_NVIDIA_WHEELS exists only in newer TE).
  NV_INCLUDES=$("$PY" - <<'PY'
import glob, os, site, sys
dirs = [p for s in site.getsitepackages() + [site.getusersitepackages()] for p in glob.glob(os.path.join(s, "nvidia", "*", "include"))]
print(os.pathsep.join(sorted(set(dirs))))
PY
)
  JOBS=${MAX_JOBS:-$(nproc)}
  BUILD_ENV=(NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_NO_LOCAL_VERSION=1 "MAX_JOBS=$JOBS")
  if [[ -n "$NV_INCLUDES" ]]; then
    BUILD_ENV+=("CPATH=${NV_INCLUDES}${CPATH:+:$CPATH}")
  fi
  echo "building the PyTorch binding from $(basename "$SDIST") with MAX_JOBS=$JOBS (the wheel stays in $WH)"
  start=$SECONDS
  env "${BUILD_ENV[@]}" "$PY" -m pip wheel --no-index --no-build-isolation --no-deps --wheel-dir "$WORK/built" "$SDIST"
  echo "built in $((SECONDS - start)) s"
  built=("$WORK"/built/*.whl)
  if [[ ${#built[@]} -ne 1 || ! -f "${built[0]}" ]]; then
    echo "error: building $SDIST gave no single wheel in $WORK/built" >&2
    exit 1
  fi
  BUILT_WHEEL="$WH/$(basename "${built[0]}")"
  mv "${built[0]}" "$BUILT_WHEEL.part"  # a wheel appears in the wheelhouse only once complete
  mv "$BUILT_WHEEL.part" "$BUILT_WHEEL"
else
  echo "using the binding built before: $(basename "$BUILT_WHEEL") (no build)"
fi
# --no-deps: its requirements were checked and installed above (REQS), without its TE core pin
"${PIP[@]}" --no-deps "$BUILT_WHEEL"

"$PY" - <<'PY'
import sys

import torch
import transformer_engine
import transformer_engine.pytorch  # noqa: F401  the binding and the core library load
from megatron.core import package_info
from megatron.core.extensions import transformer_engine as mte

print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformer_engine {transformer_engine.__version__}, "
      f"megatron-core {package_info.__version__}, HAVE_TE {mte.HAVE_TE}")
if not mte.HAVE_TE:
    sys.exit("error: megatron-core does not see TransformerEngine (HAVE_TE is False)")
PY
