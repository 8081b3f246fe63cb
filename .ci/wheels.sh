# Sourced by .ci/gpu-run and .ci/build-wheel.
# install_wheels PYTHON TARGET WHEEL...: the wheels unpacked into TARGET (pip --target, no network),
# skipped when TARGET already holds these exact wheels. Reinstalling would rewrite the CuTe headers
# with new file times, and a build tree kept between calls would then rebuild every CUDA object.
install_wheels() {
  local py=$1 target=$2 stamp
  shift 2
  stamp=$(cat "$@" | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$target/.installed-wheels" 2>/dev/null)" = "$stamp" ]; then return 0; fi
  rm -rf "$target"
  "$py" -m pip install -q --no-index --no-deps --no-compile --target "$target" "$@" \
    && echo "$stamp" > "$target/.installed-wheels"
}
