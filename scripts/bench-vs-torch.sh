#!/usr/bin/env bash
# rsrun's engine and collectives against PyTorch, side by side in one run on this machine.
#
# The reference workload (byte-level GPT D=256 L=4 H=4 T=128, B=8 per rank, AdamW, fp32, one
# compute thread per rank): engine-bench against ../shared/bench/reference_gpt.py, single process,
# DDP on 2 ranks (rsrun vs torchrun), ZeRO-3 vs FSDP2 on 2 ranks; then collectives-bench (bounds
# from memcpy and loopback TCP measured in the same run) next to gloo.
#
# Usage: scripts/bench-vs-torch.sh [--isa avx2|avx512] [STEPS]     (default 30 steps)
#   --isa avx2 runs both sides at AVX2+FMA on an AVX-512 machine (rsrun: RSRUN_ISA=avx2;
#   torch: ATEN_CPU_CAPABILITY=avx2, MKL_ENABLE_INSTRUCTIONS=AVX2, ONEDNN_MAX_CPU_ISA=AVX2), to see
#   how an AVX2-only CPU fares.
# Environment: RSRUN_BENCH_CPUS=0,1 pins every process to those CPUs (taskset), for a big machine;
# RSRUN_BENCH_ROUNDS=N rounds of every run on both sides (default 3; each side's best round counts),
# RSRUN_BENCH_BIN=DIR uses prebuilt binaries from DIR (no cargo), RSRUN_BENCH_PYTHON=PY a python
# with torch, RSRUN_BENCH_REF=DIR the folder holding reference_gpt.py and gloo_collectives.py
# (default: ../shared/bench when present, else the copies in scripts/torch-ref).
# Ends with two lines:
#   summary: single_tok_ratio_vs_torch=... ddp_tok_ratio_vs_torch=... ddp_speedup=... pair_speedup=...
#            ddp_frac_of_pair=... ddp_comm_wait_frac=... ddp_comm_thread_cpu_frac=... zero3_vs_ddp=...
#            fsdp_tok_ratio_vs_torch=... mfu=... cpu=... isa=...
#   (pair_speedup: two single-process runs at once, no communication, over one: the host's limit
#   for ddp_speedup; ddp_frac_of_pair: DDP's tokens/s over theirs; ddp_comm_wait_frac: the share
#   of the best DDP run's step its rank 0 spent waiting in collectives, ddp_comm_thread_cpu_frac:
#   the share of its core the communication thread ran on; the rest of the step is compute)
#   summary: allreduce_frac_of_bound=... reduce_scatter_frac=... all_gather_frac=... tcp_frac_of_loopback=... tcp_frac_of_exchange=...
set -euo pipefail
cd "$(dirname "$0")/.."
isa=""
if [[ ${1:-} == --isa ]]; then
  isa=${2:?--isa needs avx2 or avx512}
  shift 2
fi
steps=${1:-30}
PY=${RSRUN_BENCH_PYTHON:-$(scripts/torch-venv.sh)}
TORCHRUN=("$PY" -m torch.distributed.run)
# The anchors: RSRUN_BENCH_REF, else ../shared/bench beside the checkout, else our copies of them.
if [[ -n ${RSRUN_BENCH_REF:-} ]]; then
  refdir=$RSRUN_BENCH_REF
elif [[ -f ../shared/bench/reference_gpt.py ]]; then
  refdir=../shared/bench
else
  refdir=scripts/torch-ref
fi
REF=$refdir/reference_gpt.py
GLOO=$refdir/gloo_collectives.py
[[ -f $REF && -f $GLOO ]] || { echo "bench-vs-torch: $refdir lacks reference_gpt.py or gloo_collectives.py" >&2; exit 2; }
BIN=${RSRUN_BENCH_BIN:-target/release}
if [[ -z ${RSRUN_BENCH_BIN:-} ]]; then
  # The README's build (a narrower -p selection unifies features differently and rebuilds).
  cargo build --release -q --workspace
fi
PIN=()
if [[ -n ${RSRUN_BENCH_CPUS:-} ]]; then
  if command -v taskset >/dev/null; then
    PIN=(taskset -c "$RSRUN_BENCH_CPUS")
  else
    PIN=("$PY" -c 'import os, sys; os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(",")}); os.execvp(sys.argv[2], sys.argv[2:])' "$RSRUN_BENCH_CPUS")
  fi
fi
export OMP_NUM_THREADS=1 RAYON_NUM_THREADS=1 STEPS=$steps
# The reference GPT's shape, batch and threads, as engine-bench runs it (GptConfig::reference,
# --batch 8, one thread): set here, so that a D, B or THREADS in the caller's environment cannot
# give torch another workload (its params= is checked against ours below too).
export D=256 L=4 H=4 T=128 B=8 THREADS=1
# The workload is CPU-only on both sides: on a GPU host torch's FSDP2 would build its device mesh
# on CUDA and fail under gloo.
export CUDA_VISIBLE_DEVICES=
rounds=${RSRUN_BENCH_ROUNDS:-3}
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "bench-vs-torch: RSRUN_BENCH_ROUNDS=$rounds: expected a whole number of rounds, 1 or more" >&2; exit 2; }
case $isa in
  "") ;;
  avx2) export RSRUN_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ;;
  avx512) export RSRUN_ISA=avx512 ;;
  *) echo "bench-vs-torch: --isa $isa: expected avx2 or avx512" >&2; exit 2 ;;
esac
field() { sed -n "s/.*[ :]$1=\([^ ]*\).*/\1/p" | tail -n 1; }
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# Runs a benchmark; prints its last line matching $1, or its output and fails.
last() {
  local want=$1 out
  shift
  out=$("$@" 2>&1) || { echo "bench-vs-torch: failed: $*" >&2; echo "$out" | tail -n 20 >&2; return 1; }
  echo "$out" >>"$log"
  echo "$out" | grep "$want" | tail -n 1 | grep . || { echo "bench-vs-torch: no '$want' line from: $*" >&2; echo "$out" | tail -n 20 >&2; return 1; }
}
ours() { last 'summary:' "${PIN[@]}" "$@" --steps "$steps"; }
# A torch run that fails is reported and counted as n/a, so the rest of the comparison still runs.
theirs() { last 'tok_per_s_total' "${PIN[@]}" "$@" || echo "tok_per_s_total=n/a"; }

# The host's own limit for any two-process run: two single-process runs at once with no
# communication (each with a TMPDIR of its own, so neither touches the single-process baseline
# that the distributed runs read). DDP does the same compute plus its communication and waits for
# the slower rank each step, so its tokens/s cannot pass their sum; shared caches, memory
# bandwidth and the host's other tenants set how far that sum falls short of twice one process.
pair_tok() {
  local d1 d2 p rc=0 t1 t2
  d1=$(mktemp -d)
  d2=$(mktemp -d)
  TMPDIR=$d1 "${PIN[@]}" "$BIN/engine-bench" --steps "$steps" >"$d1/out" 2>&1 &
  p=$!
  TMPDIR=$d2 "${PIN[@]}" "$BIN/engine-bench" --steps "$steps" >"$d2/out" 2>&1 || rc=1
  wait "$p" || rc=1
  cat "$d1/out" "$d2/out" >>"$log"
  t1=$(field tok_per_s_total <"$d1/out")
  t2=$(field tok_per_s_total <"$d2/out")
  [[ -n $t1 && -n $t2 ]] || rc=1
  if ((rc)); then
    echo "bench-vs-torch: failed: two engine-bench runs at once" >&2
    tail -n 20 "$d1/out" "$d2/out" >&2
  fi
  rm -rf "$d1" "$d2"
  ((rc == 0)) || return 1
  echo "pair: tok_per_s_total=$(python3 -c 'import sys; print(round(float(sys.argv[1]) + float(sys.argv[2])))' "$t1" "$t2")"
}

tok() { echo "$1" | field tok_per_s_total; }
# Keeps in best[NAME] whichever of its old and new line has more tokens/s (a number beats n/a).
declare -A best
keep() {
  local name=$1 line=$2 old=${best[$1]:-}
  if [[ -z $old ]] || python3 -c 'import sys
def f(v):
    try: return float(v)
    except ValueError: return float("-inf")
sys.exit(0 if f(sys.argv[1]) > f(sys.argv[2]) else 1)' "$(tok "$line")" "$(tok "$old")"; then
    best[$name]=$line
  fi
}
rm -f "${TMPDIR:-/tmp}/engine-bench-single.tok_per_s"
# Each round runs every configuration on both sides, ours first in odd rounds and torch first in
# even ones; each side keeps its best round per configuration, so a slow spell of the host that
# hits one side's run in one round does not decide the ratio.
for ((round = 1; round <= rounds; round++)); do
  order=(ours theirs)
  ((round % 2)) || order=(theirs ours)
  for side in "${order[@]}"; do
    if [[ $side == ours ]]; then
      l_os=$(ours "$BIN/engine-bench")
      keep o_single "$l_os"
      l_op=$(pair_tok)
      keep o_pair "$l_op"
      l_od=$(ours "$BIN/rsrun" --standalone --nproc-per-node 2 "$BIN/engine-bench" --strategy ddp)
      keep o_ddp "$l_od"
      l_oz=$(ours "$BIN/rsrun" --standalone --nproc-per-node 2 "$BIN/engine-bench" --strategy zero3)
      keep o_z3 "$l_oz"
    else
      l_ts=$(STRATEGY=single theirs "$PY" "$REF")
      keep t_single "$l_ts"
      l_td=$(STRATEGY=ddp theirs "${TORCHRUN[@]}" --standalone --nproc-per-node 2 "$REF")
      keep t_ddp "$l_td"
      l_tf=$(STRATEGY=fsdp theirs "${TORCHRUN[@]}" --standalone --nproc-per-node 2 "$REF")
      keep t_fsdp "$l_tf"
    fi
  done
  echo "round $round of $rounds, tokens/s rsrun/torch: single $(tok "$l_os")/$(tok "$l_ts") ddp $(tok "$l_od")/$(tok "$l_td") zero3/fsdp2 $(tok "$l_oz")/$(tok "$l_tf") pair $(tok "$l_op") mfu=$(echo "$l_os" | field mfu)"
done
o_single=${best[o_single]} o_pair=${best[o_pair]} o_ddp=${best[o_ddp]} o_z3=${best[o_z3]}
t_single=${best[t_single]} t_ddp=${best[t_ddp]} t_fsdp=${best[t_fsdp]}
# The same model on both sides, or no ratio at all.
our_params=$(grep -m1 '^params=' "$log" | sed -n 's/^params=\([0-9]*\).*/\1/p')
for line in "$t_single" "$t_ddp" "$t_fsdp"; do
  their_params=$(echo "$line" | field params)
  if [[ -n $their_params && $their_params != "$our_params" ]]; then
    echo "bench-vs-torch: torch ran a model of $their_params parameters, engine-bench one of ${our_params:-?}: not the same workload" >&2
    exit 1
  fi
done

ratio() { python3 -c "import sys; a, b = sys.argv[1:]; print('n/a' if 'n/a' in (a, b) or not a or not b else f'{float(a)/float(b):.2f}')" "$1" "$2"; }
grep -m1 '^machine:' "$log"
grep -m1 '^fma_peak' "$log"
printf '%-24s %14s %14s %8s\n' "tokens/s (total), best" "rsrun" "torch" "ratio"
printf '%-24s %14s %14s %8s\n' "single process" "$(tok "$o_single")" "$(tok "$t_single")" "$(ratio "$(tok "$o_single")" "$(tok "$t_single")")"
printf '%-24s %14s %14s %8s\n' "DDP, 2 ranks" "$(tok "$o_ddp")" "$(tok "$t_ddp")" "$(ratio "$(tok "$o_ddp")" "$(tok "$t_ddp")")"
printf '%-24s %14s %14s %8s\n' "ZeRO-3 / FSDP2, 2 ranks" "$(tok "$o_z3")" "$(tok "$t_fsdp")" "$(ratio "$(tok "$o_z3")" "$(tok "$t_fsdp")")"
printf '%-24s %14s\n' "2 singles at once" "$(tok "$o_pair")"
ddp_wait=$(echo "$o_ddp" | field comm_wait_frac)
ddp_cpu=$(echo "$o_ddp" | field comm_thread_cpu_frac)
echo "rsrun: single mfu=$(echo "$o_single" | field mfu) ddp speedup=$(ratio "$(tok "$o_ddp")" "$(tok "$o_single")") (two single processes at once: $(ratio "$(tok "$o_pair")" "$(tok "$o_single")"), DDP $(ratio "$(tok "$o_ddp")" "$(tok "$o_pair")") of them; DDP's step waits ${ddp_wait:-n/a} of its time in collectives, its communication thread runs ${ddp_cpu:-n/a} of a core) zero3/ddp=$(ratio "$(tok "$o_z3")" "$(tok "$o_ddp")"); torch: ddp speedup=$(ratio "$(tok "$t_ddp")" "$(tok "$t_single")")"

coll=$("${PIN[@]}" "$BIN/collectives-bench" --spawn 2 --sizes 1024,67108864 2>&1) || {
  echo "bench-vs-torch: collectives-bench failed:" >&2
  echo "$coll" | tail -n 20 >&2
  exit 1
}
echo "$coll" | grep -E '^(limits|bound):'
gloo=$(SIZES=1024,67108864 "${PIN[@]}" "${TORCHRUN[@]}" --standalone --nproc-per-node 2 "$GLOO" 2>&1 | grep -E "world=" || true)
if [[ -n $gloo ]]; then
  echo "gloo (same run):" && echo "$gloo"
else
  echo "gloo (same run): failed or unavailable: not measured"
fi

cpu=$(grep -m1 '^machine:' "$log" | sed -n 's/.*cpu="\([^"]*\)".*/\1/p' | tr ' ' '_')
level=$(grep -m1 '^machine:' "$log" | field isa)
echo "summary: single_tok_ratio_vs_torch=$(ratio "$(tok "$o_single")" "$(tok "$t_single")") ddp_tok_ratio_vs_torch=$(ratio "$(tok "$o_ddp")" "$(tok "$t_ddp")") ddp_speedup=$(ratio "$(tok "$o_ddp")" "$(tok "$o_single")") pair_speedup=$(ratio "$(tok "$o_pair")" "$(tok "$o_single")") ddp_frac_of_pair=$(ratio "$(tok "$o_ddp")" "$(tok "$o_pair")") ddp_comm_wait_frac=${ddp_wait:-n/a} ddp_comm_thread_cpu_frac=${ddp_cpu:-n/a} zero3_vs_ddp=$(ratio "$(tok "$o_z3")" "$(tok "$o_ddp")") fsdp_tok_ratio_vs_torch=$(ratio "$(tok "$o_z3")" "$(tok "$t_fsdp")") mfu=$(echo "$o_single" | field mfu) cpu=$cpu isa=$level"
# The issue's four fractions, then the TCP all_reduce over the two-rank exchange limit.
tcp_x=$(echo "$coll" | grep '^summary:' | field tcp_frac_of_exchange)
echo "$coll" | grep '^summary:' | sed 's/^summary: \(allreduce_frac_of_bound=[^ ]* reduce_scatter_frac=[^ ]* all_gather_frac=[^ ]* tcp_frac_of_loopback=[^ ]*\).*/summary: \1/' | sed "s/\$/ tcp_frac_of_exchange=${tcp_x:-n\/a}/"
