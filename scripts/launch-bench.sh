#!/usr/bin/env bash
# Launch overhead of rsrun: 8 trivial workers with --standalone (wall time, overhead against starting
# them directly, peak RSS of the launcher) and 8 launchers x 1 worker through the rendezvous daemon
# on loopback. Ends with two `summary:` lines.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p rsrun-launcher -p rsrun-rendezvous --bins
cargo build --release -q -p rsrun-examples --bin launch-bench
exec target/release/launch-bench "$@"
