#!/usr/bin/env bash
# Launch overhead of rsrun: 8 trivial workers with --standalone (wall time, overhead against starting
# them directly, peak RSS of the launcher) and 8 launchers x 1 worker through the rendezvous daemon
# on loopback. Ends with two `summary:` lines.
set -euo pipefail
cd "$(dirname "$0")/.."
# The README's build: the same features as `cargo build --release --workspace`, so that after it
# this rebuilds nothing (a narrower -p selection unifies dependency features differently and
# recompiles them over the workspace's binaries).
cargo build --release -q --workspace
exec target/release/launch-bench "$@"
