#!/usr/bin/env bash
# Runs the PyTorch compatibility test (gloo all_reduce across 2 nodes x 2 workers, unmodified
# init_process_group with env://) in a virtual environment with torch. The first run downloads torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(../shared/bench/setup-torch.sh "${1:-}")
cargo build --workspace -q
RSRUN_TEST_PYTHON="$PY" cargo test -p rsrun-tests --test e2e -- torch:: --nocapture
