#!/usr/bin/env bash
# Assemble the wheelhouse for tools/install_gpu_offline.sh on a machine with registry access, for a
# GPU node with Python 3.12 on manylinux x86_64. See docs/gpu.md, "Installing on an air-gapped GPU
# node".
#
#   tools/download_gpu_wheelhouse.sh DIR cu12|cu13 [TE_VERSION]
#
# cu12 or cu13: the CUDA major of the node's torch (python -c "import torch; print(torch.version.cuda)").
# TE_VERSION defaults to 2.11.0, the newest inside megatron-core 0.16.1's range (>=2.9.0a0,<2.12.0).
# Environment: PYTHON_VERSION (default 3.12), ARCH (default x86_64), PYPI_URL (default https://pypi.org).
# torch is never downloaded: the node's CUDA torch stays. Ends with DIR/SHA256SUMS, which the install
# script checks, so files split for a size-limited link can be joined and verified on the node.
set -euo pipefail

if [[ $# -lt 2 || $# -gt 3 || "$1" == -* ]]; then
  echo "usage: tools/download_gpu_wheelhouse.sh DIR cu12|cu13 [TE_VERSION]" >&2
  exit 2
fi
DIR=$1 CU=$2 TE=${3:-2.11.0}
if [[ "$CU" != cu12 && "$CU" != cu13 ]]; then
  echo "error: CUDA choice $CU: expected cu12 or cu13 (the CUDA major of the node's torch)" >&2
  exit 2
fi
if [[ ! "$TE" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  echo "error: TE_VERSION $TE: expected a release such as 2.11.0" >&2
  exit 2
fi
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYV=${PYTHON_VERSION:-3.12}
ARCH=${ARCH:-x86_64}
mkdir -p "$DIR"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# The node's tags, whatever this machine is; binary wheels only (sdists would build here)
TARGET=(--only-binary=:all: --python-version "$PYV" --implementation cp --abi "cp${PYV/./}"
        --platform "manylinux_2_28_$ARCH" --platform "manylinux_2_17_$ARCH" --platform "manylinux2014_$ARCH"
        --platform "manylinux_2_24_$ARCH")
grep -v -i '^torch==' "$ROOT/constraints.txt" >"$WORK/constraints.txt"

# megatron-core's and TE's own requirements name torch (or are extras): no dependencies followed
python3 -m pip download --dest "$DIR" "${TARGET[@]}" --no-deps \
  megatron-core==0.16.1 "transformer_engine_${CU}==$TE" "transformer_engine==$TE"

# What they need besides torch (the binding imports onnx and onnxscript), this project's runtime
# requirements (setup.py) and the binding's build tools, with their dependencies, at
# constraints.txt's versions
mapfile -t PROJECT < <(python3 - "$ROOT/setup.py" <<'PY'
import ast, sys
tree = ast.parse(open(sys.argv[1]).read())
reqs = next(ast.literal_eval(k.value) for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords
            if k.arg == "install_requires")
print("\n".join(r for r in reqs if not r.startswith(("torch", "megatron-core"))))
PY
)
python3 -m pip download --dest "$DIR" "${TARGET[@]}" -c "$WORK/constraints.txt" \
  numpy "packaging>=24.2" pydantic "importlib-metadata>=1.0" einops onnx onnxscript setuptools wheel "${PROJECT[@]}"

# The binding's sdist: pip download would build its metadata, which needs a CUDA torch, so fetch the
# file the index lists and check it against the index's sha256
python3 - "$DIR" "$TE" "${PYPI_URL:-https://pypi.org}" <<'PY'
import hashlib, json, sys, urllib.request
from pathlib import Path

out, te, index = Path(sys.argv[1]), sys.argv[2], sys.argv[3].rstrip("/")
with urllib.request.urlopen(f"{index}/pypi/transformer-engine-torch/json", timeout=60) as r:
    release = json.load(r)["releases"].get(te, [])
files = [f for f in release if f["packagetype"] == "sdist"]
if not files:
    sys.exit(f"error: {index} lists no transformer_engine_torch {te} sdist")
f = files[0]
with urllib.request.urlopen(urllib.request.urljoin(f"{index}/pypi/transformer-engine-torch/json", f["url"]),
                            timeout=300) as r:
    data = r.read()
if hashlib.sha256(data).hexdigest() != f["digests"]["sha256"]:
    sys.exit(f"error: {f['filename']}: sha256 differs from the index's")
(out / f["filename"]).write_bytes(data)
print(f"saved {f['filename']} ({len(data)} bytes)")
PY

(cd "$DIR" && find . -maxdepth 1 -type f \( -name '*.whl' -o -name '*.tar.gz' \) -printf '%f\n' | sort \
  | xargs -d '\n' sha256sum >SHA256SUMS)
echo "$DIR: $(wc -l <"$DIR/SHA256SUMS") files, $(du -sh "$DIR" | cut -f1); largest:"
find "$DIR" -maxdepth 1 -type f -printf '%s bytes  %f\n' | sort -rn | head -3
echo "Where a link limits file size: split -b 1000M FILE FILE.part- ; on the node: cat FILE.part-* >FILE"
echo "(tools/install_gpu_offline.sh checks every file against SHA256SUMS)"
