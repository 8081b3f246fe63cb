#!/usr/bin/env bash
# A/B timing of the Hopper backward across source trees (benchmarks/ab_sm90_bwd.cu), or with
# AB_SOURCE=benchmarks/ab_sm90_fwd_masks.cu of the forward's mask kernels (its MODE: one mask
# pattern, or every one by default).
#   bash benchmarks/ab_sm90_bwd.sh build ROOT...   one binary per ROOT (a directory holding a cuda/
#                                                  tree: "." or `git archive <commit> cuda | tar -x -C
#                                                  .ab/<name>`), into .ab/bin/<i>-<name>; needs nvcc and
#                                                  nvidia-cutlass, not a GPU (~90 s per head dim and root
#                                                  on 2 cores), so the binaries can be built here and
#                                                  carried (the ignored .ab/) to the GPU machine.
#   bash benchmarks/ab_sm90_bwd.sh run [ROUNDS [MIN_T [MODE]]]
#                                                  every binary in .ab/bin in turn, AB_PASSES times
#                                                  (default 2), so that clock drift reaches each alike;
#                                                  only the cases with T >= MIN_T. MODE: plain
#                                                  (default), dropout, det (deterministic=True), or
#                                                  a bit-packed mask: causal, block50, block10 or random50
#                                                  (ab_sm90_bwd.cu's header).
# AB_HDIM: the head dim compiled in (64, 128 or 256; default 128). AB_BIN: the binaries' folder
# (default .ab/bin). AB_NVCC_FLAGS: more nvcc flags,
# e.g. -DAB_LAUNCH_WITHOUT_POLICIES for trees whose launch_bwd takes no policy set, -UAB_DROPOUT for
# trees without the dropout kernel (which also halves the compile time).
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${AB_BIN:-.ab/bin}
case "${1:-}" in
  build)
    shift
    [ $# -ge 1 ] || { echo "usage: $0 build ROOT..."; exit 2; }
    cutlass=$(python3 -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))") \
      || { echo "nvidia-cutlass is not importable (pip install nvidia-cutlass, or put its wheel's folder on PYTHONPATH)"; exit 1; }
    mkdir -p "$bin"
    i=0
    for root in "$@"; do
      name=$(basename "$(cd "$root" && pwd)")
      out="$bin/$i-$name-h${AB_HDIM:-128}"
      nvcc -std=c++17 -O3 --use_fast_math --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
        -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED -DAB_HDIM="${AB_HDIM:-128}" -DAB_DROPOUT -DAB_ROOT="\"$name\"" ${AB_NVCC_FLAGS:-} \
        -I"$root/cuda" -I"$root/cuda/include" -isystem "$cutlass" "${AB_SOURCE:-benchmarks/ab_sm90_bwd.cu}" -o "$out" \
        > "$out.log" 2>&1 &
      i=$((i + 1))
    done
    wait
    for f in "$bin"/*.log; do [ -x "${f%.log}" ] || { echo "failed: ${f%.log}"; grep -E "error" "$f" | head -5; }; done
    ls "$bin" | grep -v '\.log$'
    ;;
  run)
    for pass in $(seq "${AB_PASSES:-2}"); do
      for b in "$bin"/*; do
        [ -x "$b" ] && [ "${b%.log}" = "$b" ] && timeout 120 "$b" "${2:-15}" "${3:-0}" "${4:-plain}"
      done
    done
    ;;
  *) echo "usage: $0 build ROOT... | run [ROUNDS [MIN_T [MODE]]]"; exit 2 ;;
esac
