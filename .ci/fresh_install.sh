#!/usr/bin/env bash
# CI (issue 14): a fresh venv with only `pip install .` imports rfattn and builds all nine weight
# matrices. The package is installed, non-editable and without extras, from a copy of the checkout
# (tracked and untracked files, none that git ignores: no .venv, build/, *.egg-info), so that only
# setup.cfg's install_requires can satisfy its imports; the check then runs outside the checkout
# so that the source tree is not on sys.path and rfattn must come from the venv's site-packages.
#
# TORCH (as in the Makefile, e.g. TORCH=torch==2.13.0) only pins torch: it goes into a constraints
# file, which limits the version pip picks for install_requires' torch>=2.4 but installs nothing
# by itself. torch==2.13.0 is the CPU build that lies on disk; unpinned, pip would resolve torch
# to the multi-GB CUDA build. Bare `torch` (the default) pins nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd -P)
python=${PYTHON:-python3}
torch_req=${TORCH:-torch}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

mkdir "$tmp/src" "$tmp/run"
git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do if [ -e "$f" ]; then printf '%s\0' "$f"; fi; done \
    | tar --null -T - -cf - | tar -C "$tmp/src" -xf -

"$python" -m venv "$tmp/venv"
py=$tmp/venv/bin/python
constraints=()
if [ "$torch_req" != torch ]; then
    printf '%s\n' "$torch_req" >"$tmp/constraints.txt"
    constraints=(-c "$tmp/constraints.txt")
fi
"$py" -m pip install -q ${constraints[@]+"${constraints[@]}"} "$tmp/src"
"$py" -m pip check

# -I: no PYTHONPATH, no user site, and neither the script's nor the current folder on sys.path.
cd "$tmp/run"
"$py" -I - "$repo" <<'EOF'
import os
import sys
import sysconfig
from importlib.metadata import version

import torch

import rfattn
from rfattn.features import VALID_WEIGHTS
from rfattn.weights import WEIGHTS, sgq_size

repo = os.path.realpath(sys.argv[1])
site = os.path.realpath(sysconfig.get_paths()["purelib"])
where = os.path.realpath(rfattn.__file__)
assert where.startswith(site + os.sep), f"rfattn imported from {where}, not from {site}"
assert not where.startswith(repo + os.sep), f"rfattn imported from the checkout: {where}"
deps = ", ".join(f"{d} {version(d)}" for d in ("torch", "triton", "numpy", "scipy"))
print(f"rfattn {rfattn.__version__} from {where}; {deps}")

EXPECTED = 9
names = list(rfattn.ALL_WEIGHTS)
assert names == list(WEIGHTS), (names, list(WEIGHTS))
D = 8
M = sgq_size(D, 1)  # 2D+1, an M the sgq rule has; every other matrix takes any M
# the first feature that accepts each matrix, posrf (the default) before the others
features = sorted(VALID_WEIGHTS, key=lambda f: f != "posrf")
for name in names:
    feature = next((f for f in features if name in VALID_WEIGHTS[f]), None)
    assert feature is not None, f"no feature accepts weights={name!r}"
    rf = rfattn.RandomFeatures(D, M, feature, weights=name, seed=0)
    w = rf.weight
    assert tuple(w.shape) == (M, D), f"{name}: shape {tuple(w.shape)}, expected {(M, D)}"
    assert bool(torch.isfinite(w).all()), f"{name}: non-finite entries"
    assert bool(w.abs().sum() > 0), f"{name}: all zeros"
    print(f"  {name:<10} with {feature:<6} W {tuple(w.shape)} {w.dtype} finite")
assert len(names) == EXPECTED, f"{len(names)} weight matrices, expected {EXPECTED}: {names}"

g = torch.Generator().manual_seed(0)
q, k = torch.randn(2, 1, 2, 5, D, generator=g)
v = torch.randn(1, 2, 5, 4, generator=g)
rf = rfattn.RandomFeatures(D, 16, "posrf", weights="orf", seed=0)
for causal in (False, True):
    out = rfattn.rf_attention(q, k, v, rf, causal=causal, backend="torch")
    assert tuple(out.shape) == (1, 2, 5, 4), tuple(out.shape)
    assert bool(torch.isfinite(out).all()), f"rf_attention(causal={causal}): non-finite output"
print(f"fresh_install: {len(names)} weight matrices built, rf_attention(backend='torch') ran")
EOF
