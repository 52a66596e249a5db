#!/usr/bin/env bash
# Makes (once) a Python virtual environment with PyTorch for the PyTorch compatibility tests and the
# side-by-side benchmarks, and prints its python path on stdout.
#
# Usage: scripts/torch-venv.sh [VENV_DIR]      (default: $HOME/.cache/rsrun-torch-venv)
#
# Only PyPI is reachable from CI, and PyPI's Linux torch wheel depends on the CUDA libraries (~4 GB).
# The script first tries the wheel alone with its pure-Python dependencies (enough when torch imports
# without the CUDA libraries); when torch does not import that way it installs the full set.
set -euo pipefail
venv=${1:-$HOME/.cache/rsrun-torch-venv}
py=$venv/bin/python
have_torch() { [[ -x $py ]] && "$py" -c 'import torch, torch.distributed as d; assert d.is_available()' 2>/dev/null; }
if have_torch; then
  echo "$py"
  exit 0
fi
python3 -m venv "$venv" >&2
"$venv/bin/pip" install -q --disable-pip-version-check --upgrade pip >&2 || true
echo "torch-venv: installing torch into $venv (first time only)" >&2
"$venv/bin/pip" install -q --disable-pip-version-check --no-deps torch >&2
"$venv/bin/pip" install -q --disable-pip-version-check numpy filelock typing-extensions sympy networkx jinja2 fsspec pytest expecttest >&2
if ! have_torch; then
  echo "torch-venv: torch does not import without its CUDA libraries; installing them too" >&2
  "$venv/bin/pip" install -q --disable-pip-version-check torch >&2
fi
have_torch || { echo "torch-venv: torch still does not import from $py" >&2; exit 1; }
echo "$py"
