#!/usr/bin/env bash
# CI (issue 13): `make test PY=...` in an environment that already holds torch and triton creates
# no venv and downloads nothing. A hand-made venv gets the CPU torch build that lies on disk and
# the suite's dependencies (setup.cfg's extras); then the suite runs in it with the package index
# switched off, and neither that environment's packages (rfattn aside) nor .venv may change.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

python3 -m venv "$tmp/env"
py=$tmp/env/bin/python
"$py" -m pip install -q --upgrade pip
# torch==2.13.0 is the CPU build on disk: plain `torch` would pull the multi-GB CUDA build.
"$py" -m pip install -q torch==2.13.0 triton numpy setuptools \
    pytest scipy pytest-benchmark matplotlib "transformers>=5.0" hypothesis
"$py" -m pip freeze --exclude-editable >"$tmp/before.txt"

had_venv=0
if [ -e .venv ]; then had_venv=1; fi
touch "$tmp/start"

PIP_NO_INDEX=1 make test PY="$py" PYTEST_ARGS="${PYTEST_ARGS:--q}"

"$py" -m pip freeze --exclude-editable >"$tmp/after.txt"
if ! diff -u "$tmp/before.txt" "$tmp/after.txt" >&2; then
    echo "existing_env: make test PY=... changed the environment's packages" >&2
    exit 1
fi
if [ "$had_venv" = 0 ] && [ -e .venv ]; then
    echo "existing_env: make test PY=... created .venv" >&2
    exit 1
fi
if [ "$had_venv" = 1 ] && [ -n "$(find .venv -newer "$tmp/start" -print -quit)" ]; then
    echo "existing_env: make test PY=... wrote into .venv: $(find .venv -newer "$tmp/start" | head -3)" >&2
    exit 1
fi
