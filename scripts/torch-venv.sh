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
# Pinned: the TCPStore conformance tests and the side-by-side figures are for this torch, and a new
# release must not change CI for an unrelated change (README quotes its figures as torch 2.15).
TORCH_VERSION=2.15.0
have_torch() {
  [[ -x $py ]] && "$py" -c "import torch, torch.distributed as d; assert d.is_available(); assert torch.__version__.split('+')[0] == '$TORCH_VERSION', torch.__version__" 2>/dev/null
}
if have_torch; then
  echo "$py"
  exit 0
fi
python3 -m venv "$venv" >&2
"$venv/bin/pip" install -q --disable-pip-version-check --upgrade pip >&2 || true
echo "torch-venv: installing torch into $venv (first time only)" >&2
"$venv/bin/pip" install -q --disable-pip-version-check --no-deps "torch==$TORCH_VERSION" >&2
"$venv/bin/pip" install -q --disable-pip-version-check numpy filelock typing-extensions sympy networkx jinja2 fsspec "pytest==9.2.0" "expecttest==0.3.0" >&2
if ! have_torch; then
  echo "torch-venv: torch does not import without its CUDA libraries; installing them too" >&2
  "$venv/bin/pip" install -q --disable-pip-version-check "torch==$TORCH_VERSION" >&2
fi
have_torch || { echo "torch-venv: torch still does not import from $py" >&2; exit 1; }
echo "$py"
