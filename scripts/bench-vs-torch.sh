#!/usr/bin/env bash
# The reference workload (byte-level GPT D=256 L=4 H=4 T=128, B=8 per rank, AdamW, fp32, one compute
# thread per rank) with rsrun + train and with torchrun + reference_gpt.py, in the same session:
# single process, DDP on 2 ranks, ZeRO-3/FSDP on 2 ranks. Prints a ratio table and a summary line.
# Usage: scripts/bench-vs-torch.sh [STEPS]   (default 30; the first run installs torch in a venv)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-30}
PY=$(scripts/torch-venv.sh)
TORCHRUN=$(dirname "$PY")/torchrun
REF=../shared/bench/reference_gpt.py
cargo build --release -q -p rsrun-launcher -p rsrun-examples --bin rsrun --bin train
export OMP_NUM_THREADS=1 RAYON_NUM_THREADS=1 STEPS=$steps
field() { sed -n "s/.*$1=\([0-9.]*\).*/\1/p" | tail -n 1; }
ours() { "$@" --steps "$steps" --log-format json 2>/dev/null | grep 'summary:' | field tok_per_s_total; }
theirs() { "$@" 2>/dev/null | grep 'tok_per_s_total' | field tok_per_s_total; }

r_single=$(ours target/release/train)
r_ddp=$(ours target/release/rsrun --standalone --nproc-per-node 2 target/release/train --strategy ddp)
r_fsdp=$(ours target/release/rsrun --standalone --nproc-per-node 2 target/release/train --strategy zero3)
t_single=$(STRATEGY=single theirs "$PY" "$REF")
t_ddp=$(STRATEGY=ddp theirs "$TORCHRUN" --standalone --nproc-per-node 2 "$REF")
t_fsdp=$(STRATEGY=fsdp theirs "$TORCHRUN" --standalone --nproc-per-node 2 "$REF")

ratio() { python3 -c "print(f'{$1/$2:.2f}')"; }
printf '%-22s %14s %14s %8s\n' "tokens/s (total)" "rsrun+train" "torch" "ratio"
printf '%-22s %14s %14s %8s\n' "single process" "$r_single" "$t_single" "$(ratio "$r_single" "$t_single")"
printf '%-22s %14s %14s %8s\n' "DDP, 2 ranks" "$r_ddp" "$t_ddp" "$(ratio "$r_ddp" "$t_ddp")"
printf '%-22s %14s %14s %8s\n' "ZeRO-3/FSDP, 2 ranks" "$r_fsdp" "$t_fsdp" "$(ratio "$r_fsdp" "$t_fsdp")"
echo "summary: ddp_tok_ratio_vs_torch=$(ratio "$r_ddp" "$t_ddp") fsdp_tok_ratio_vs_torch=$(ratio "$r_fsdp" "$t_fsdp") ddp_speedup_vs_single=$(ratio "$r_ddp" "$r_single") torch_ddp_speedup_vs_single=$(ratio "$t_ddp" "$t_single")"
