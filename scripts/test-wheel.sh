#!/usr/bin/env bash
# Builds rsrun's pip wheel and checks it in fresh virtual environments:
#   1. maturin (from PyPI) in a build venv; `maturin build --release` (only the launcher's and the
#      rendezvous's crates and their dependencies: the script checks candle is not among them);
#   2. the wheel in a fresh venv: `rsrun --version`, `rsrun-rendezvous --version`,
#      `python -m rsrun --help`, and two ranks started by `python -m rsrun --standalone`;
#   3. `pip install .` (the README's command, through maturin's PEP 517 backend) in another venv;
#   4. when the PyTorch venv exists ($HOME/.cache/rsrun-torch-venv, see scripts/torch-venv.sh): the
#      wheel installed there, and a gloo all_reduce over 2 workers through the installed `rsrun`.
# Needs python3 with venv, the Rust toolchain, and PyPI (pip fetches maturin). Prints PASS or
# FAILED with the reason; exits non-zero on failure. Usage: scripts/test-wheel.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
python=${PYTHON:-python3}
# A target directory of its own: the wheel's feature set differs from the workspace's, and
# building it into target/release would recompile dependencies over the workspace's binaries.
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target/wheel}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
started=$SECONDS

step() { printf '\n== %s (%ss)\n' "$*" "$((SECONDS - started))"; }
fail() {
  printf 'test-wheel: FAILED: %s\n' "$*" >&2
  exit 1
}
pip_quiet() { "$@" -q --disable-pip-version-check; }

step "the wheel's dependency graph has no candle"
if cargo tree -p rsrun-wheel --features wheel -e normal --prefix none --locked | grep -q '^candle'; then
  fail "the wheel would build candle (rsrun-wheel depends on it)"
fi

step "maturin from PyPI"
"$python" -m venv "$work/build"
pip_quiet "$work/build/bin/pip" install "maturin>=1.9,<2"
"$work/build/bin/maturin" --version

step "maturin build --release"
"$work/build/bin/maturin" build --release --out "$work/dist" 2>&1 | grep -v '^ *Compiling ' || true
shopt -s nullglob
wheels=("$work"/dist/rsrun-*.whl)
[[ ${#wheels[@]} -eq 1 ]] || fail "expected one wheel in $work/dist, found ${#wheels[@]}"
wheel=${wheels[0]}
contents=$("$python" -m zipfile -l "$wheel")
for f in rsrun/__main__.py rsrun-*.data/scripts/rsrun rsrun-*.data/scripts/rsrun-rendezvous; do
  grep -q "^${f//\*/[^ ]*} " <<<"$contents" || fail "the wheel has no $f:"$'\n'"$contents"
done
echo "built $(basename "$wheel") ($(du -h "$wheel" | cut -f1))"

# Checks an environment where rsrun is installed: $1 is its bin directory.
check_installed() {
  local bin=$1 out
  # Run outside the repository, with the venv first on PATH (as `activate` does).
  (
    cd "$work"
    export PATH="$bin:$PATH"
    [[ $(command -v rsrun) == "$bin/rsrun" ]] || fail "rsrun is not the installed one: $(command -v rsrun)"
    rsrun --version
    rsrun-rendezvous --version
    python -m rsrun --help >/dev/null || fail "python -m rsrun --help"
    out=$(python -m rsrun --standalone --nproc-per-node 2 python -c 'import os; print(os.environ["RANK"])' 2>&1) ||
      fail "python -m rsrun --standalone exited $?: $out"
    grep -qx '\[rank 0\] 0' <<<"$out" && grep -qx '\[rank 1\] 1' <<<"$out" ||
      fail "both ranks should print their RANK:"$'\n'"$out"
    echo "python -m rsrun: both ranks ran"
  )
}

step "the wheel in a fresh venv"
"$python" -m venv "$work/run"
pip_quiet "$work/run/bin/pip" install "$wheel"
check_installed "$work/run/bin"

step "pip install . (the README's command) in a fresh venv"
"$python" -m venv "$work/src"
pip_quiet "$work/src/bin/pip" install "$root"
check_installed "$work/src/bin"

torch_venv="$HOME/.cache/rsrun-torch-venv"
if [[ -x $torch_venv/bin/python ]] && "$torch_venv/bin/python" -c 'import torch' 2>/dev/null; then
  step "the wheel in the PyTorch venv: gloo all_reduce with 2 workers"
  pip_quiet "$torch_venv/bin/pip" install --force-reinstall --no-deps "$wheel"
  (
    cd "$work"
    export PATH="$torch_venv/bin:$PATH"
    cp "$root/tests/python/allreduce.py" .
    out=$(rsrun --standalone --nproc-per-node 2 allreduce.py 2>&1) || fail "rsrun allreduce.py exited $?: $out"
    for r in 0 1; do
      grep -q "allreduce ok rank=$r world=2 sum=3.0" <<<"$out" || fail "rank $r did not all_reduce:"$'\n'"$out"
    done
    echo "gloo all_reduce ok on both ranks"
  )
else
  step "skipped the PyTorch check: no torch in $torch_venv (scripts/torch-venv.sh makes it)"
fi

printf '\ntest-wheel: PASS (%ss)\n' "$((SECONDS - started))"
