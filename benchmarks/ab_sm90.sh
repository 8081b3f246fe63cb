#!/usr/bin/env bash
# A/B timing of Hopper forward variants, on the GPU machine: each ROOT is a directory holding a
# cuda/ tree (the working tree is "."; a baseline can be `git archive <commit> cuda | tar -x -C
# .ab/base`, carried to the machine as an ignored path). Builds the bf16 sm90 forward of every
# ROOT with nvcc alone (no CMake, no Python; head dims AB_HDIMS, default "64 128 256") into its own
# tests/cuda/sm90_check binary, then runs `sm90_check MODE` of each ROOT in turn, AB_ROUNDS times
# (default 3), so that clock and temperature drift reach every variant alike. Compare the BENCH
# lines per variant across rounds (medians), never one round alone. AB_CHECK=1 first runs each
# variant's correctness sweep (sm90_check with no mode; $OUT/check-<i>.log), so that no timing is
# read off a variant that computes wrong results.
# AB_BUILD_DIR (default /tmp/jfa-ab-build) holds the variants' objects and binaries, one folder each.
# JFA_BENCH_ROUNDS=1 (passed through to sm90_check) adds every round's time of --masks (ROUNDS lines).
#   bash benchmarks/ab_sm90.sh --lengths ROOT...     (or --masks, --bench; or several: --masks,--lengths)
set -uo pipefail
cd "$(dirname "$0")/.."
mode=$1; shift
[ $# -ge 1 ] || { echo "usage: $0 --lengths|--masks|--bench[,...] ROOT..."; exit 2; }
OUT=${OUT:-/tmp/jfa-ab}
build=${AB_BUILD_DIR:-/tmp/jfa-ab-build}  # variant i in $build/i
mkdir -p "$OUT" "$build"
cutlass=$(python3 -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))") \
  || { echo "nvidia-cutlass is not importable (run .ci/gpu-run build first, or put .whl/ on PYTHONPATH)"; exit 1; }
hdims=${AB_HDIMS:-64 128 256}
mask=0
for h in $hdims; do  # JFA_SM90_BUILT_MASK: bit 3 + head-dim index for bf16 (cuda/sm90/api.cu)
  case $h in 64) mask=$((mask | 8)) ;; 128) mask=$((mask | 16)) ;; 256) mask=$((mask | 32)) ;; esac
done
flags=(-std=c++17 -O3 --use_fast_math --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a
       -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED -DJFA_SM90_BUILT_MASK=${mask}u -DJFA_CHECK_NO_SM80)
start=$(date +%s)
i=0
for root in "$@"; do
  obj=$build/$i
  mkdir -p "$obj"
  inc=(-I"$root/cuda" -I"$root/cuda/include" -Icuda -Itests/cuda -isystem "$cutlass")
  srcs=("$root/cuda/sm90/api.cu" tests/cuda/sm90_check.cu)
  for h in $hdims; do  # the dropout kernel's and the backward's files (one per policy set), where the tree has them
    for f in "$root"/cuda/instantiations/sm90_{fwd_bf16_hdim${h}{,_dropout},bwd_bf16_hdim${h}{,_*}}.cu; do
      [ -f "$f" ] && srcs+=("$f")
    done
  done
  for src in "${srcs[@]}"; do
    nvcc "${flags[@]}" "${inc[@]}" -c "$src" -o "$obj/$(basename "$src").o" > "$obj/$(basename "$src").log" 2>&1 &
  done
  i=$((i + 1))
done
wait
i=0
for root in "$@"; do
  obj=$build/$i
  nvcc -gencode=arch=compute_90a,code=sm_90a "$obj"/*.o -lcuda -o "$obj/sm90_check" \
    || { cat "$obj"/*.log | grep -E "error" | head -20; exit 1; }
  i=$((i + 1))
done
echo "ab: built $# variants in $(( $(date +%s) - start )) s"
if [ "${AB_CHECK:-0}" = 1 ]; then
  for i in $(seq 0 $(($# - 1))); do
    timeout 200 $build/$i/sm90_check > "$OUT/check-$i.log" 2>&1
    echo "check variant $i: exit $? ($(grep -c PASS "$OUT/check-$i.log") PASS, $(grep -E 'failures' "$OUT/check-$i.log"))"
    grep FAIL "$OUT/check-$i.log" | head -5
  done
fi
for r in $(seq 1 "${AB_ROUNDS:-3}"); do
  i=0
  for root in "$@"; do
    for m in ${mode//,/ }; do
      echo "== round $r variant $i ($root) $m"
      timeout 300 $build/$i/sm90_check "$m" 2>&1 | grep -E "BENCH|MASKS|ROUNDS|FAIL" | tee -a "$OUT/ab-$i.log"
    done
    i=$((i + 1))
  done
done
