#!/usr/bin/env bash
# A/B timing of portable (sm80) kernel variants, chiefly the backward, on the GPU machine: the
# sm80 twin of benchmarks/ab_sm90.sh. Each ROOT is a directory holding a cuda/ tree (the working
# tree is "."; a baseline can be `git archive <commit> cuda | tar -x -C .ab/base`, carried to the
# machine as an ignored path). Builds the bf16 sm80 kernels of every ROOT for head dims AB_HDIMS
# (default "128") with nvcc alone, for the GPU's own architecture (AB_ARCH, default 90), into its
# own tests/cuda/sm80_check binary, then runs `sm80_check --bench H CAUSAL` for each of AB_CASES
# (default "128,0 128,1") and each ROOT in turn, AB_ROUNDS times (default 3), so that clock and
# temperature drift reach every variant alike. Each BENCH line times the default backward and the
# deterministic one on the same problem. AB_CHECK=1 first runs each variant's correctness sweep
# (sm80_check with no mode, the built head dims only; $OUT/check80-<i>.log). AB_SKIP_BUILD=1 reuses
# the binaries of the last build (to run the checks and rounds after other work on the GPU).
#   bash benchmarks/ab_sm80.sh ROOT...
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 ROOT..."; exit 2; }
OUT=${OUT:-/tmp/jfa-ab}
mkdir -p "$OUT" /tmp/jfa-ab80-build
cutlass=$(python3 -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))") \
  || { echo "nvidia-cutlass is not importable (run .ci/gpu-run build first, or put .whl/ on PYTHONPATH)"; exit 1; }
hdims=${AB_HDIMS:-128}
arch=${AB_ARCH:-90}
mask=0
for h in $hdims; do  # JFA_SM80_BUILT_MASK: bit 6 + head-dim index for bf16 (cuda/sm80/api.cu)
  case $h in 32) b=6 ;; 64) b=7 ;; 96) b=8 ;; 128) b=9 ;; 192) b=10 ;; 256) b=11 ;; *) echo "bad head dim $h"; exit 2 ;; esac
  mask=$((mask | (1 << b)))
done
flags=(-std=c++17 -O3 --use_fast_math --expt-relaxed-constexpr -lineinfo
       -gencode=arch=compute_${arch},code=sm_${arch} -DJFA_SM80_BUILT_MASK=${mask}u)
# One nvcc per source, at most AB_JOBS (default: the cores) at a time: all at once (64 jobs for
# three head dims of two roots) left objects missing and the link failed, most likely for memory.
compile_one() {  # ROOT_INDEX ROOT SOURCE
  local obj=/tmp/jfa-ab80-build/$1
  nvcc "${flags[@]}" -I"$2/cuda" -I"$2/cuda/include" -Itests/cuda -isystem "$cutlass" -c "$3" \
    -o "$obj/$(basename "$3").o" > "$obj/$(basename "$3").log" 2>&1 || echo "ab80: FAILED $3 (root $2)"
}
export -f compile_one; export cutlass; export flags_str="${flags[*]}"
build() {
  start=$(date +%s)
  i=0
  for root in "$@"; do
    rm -rf "/tmp/jfa-ab80-build/$i"; mkdir -p "/tmp/jfa-ab80-build/$i"
    echo "$i $root $root/cuda/sm80/api.cu"
    echo "$i $root tests/cuda/sm80_check.cu"
    for h in $hdims; do
      for src in "$root"/cuda/instantiations/sm80_{fwd,bwd}_bf16_hdim${h}_*.cu; do echo "$i $root $src"; done
    done
    i=$((i + 1))
  done | xargs -P "${AB_JOBS:-$(nproc)}" -L 1 bash -c 'flags=($flags_str); compile_one "$@"' _
  i=0
  for root in "$@"; do
    obj=/tmp/jfa-ab80-build/$i
    nvcc -gencode=arch=compute_${arch},code=sm_${arch} "$obj"/*.o -o "$obj/sm80_check" \
      || { grep -h -E "error" "$obj"/*.log | head -20; exit 1; }
    i=$((i + 1))
  done
  echo "ab80: built $# variants in $(( $(date +%s) - start )) s"
}
[ "${AB_SKIP_BUILD:-0}" = 1 ] || build "$@" || exit 1
if [ "${AB_CHECK:-0}" = 1 ]; then
  for i in $(seq 0 $(($# - 1))); do
    timeout 300 /tmp/jfa-ab80-build/$i/sm80_check > "$OUT/check80-$i.log" 2>&1
    echo "check variant $i: exit $? ($(grep -c PASS "$OUT/check80-$i.log") PASS, $(grep -E 'failures' "$OUT/check80-$i.log"))"
    grep -E "FAIL|determin" "$OUT/check80-$i.log" | grep -v PASS | head -5
  done
fi
for r in $(seq 1 "${AB_ROUNDS:-3}"); do
  i=0
  for root in "$@"; do
    for c in ${AB_CASES:-128,0 128,1}; do
      echo "== round $r variant $i ($root) $c"
      timeout 120 /tmp/jfa-ab80-build/$i/sm80_check --bench ${c/,/ } 2>&1 | grep -E "BENCH|FAIL|error" \
        | tee -a "$OUT/ab80-$i.log"
    done
    i=$((i + 1))
  done
done
