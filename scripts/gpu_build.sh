# Sourced by the scripts/gpu_*.sh: builds and installs jaxquant with its CUDA library on
# the GPU machine, the documented one-liner (no network: the machine's scikit-build-core,
# CMake, ninja and jaxlib headers), and points the source tree at the built library.
#
#   source scripts/gpu_build.sh; gpu_build "$OUT/build.log" || exit 1
#
# With JAXQUANT_FFI_LIBRARY naming a library that loads, nothing is built.
#
# Wheels the machine lacks (nvidia-cutlass, for the GEMM kernels' headers) travel in .whl/
# (git-ignored; README's "Building on the GPU machine" says how to fetch them) and are
# installed into /tmp/site first.

gpu_build() {  # $1: log file
  local log=$1 start=$(date +%s)
  # A library built beforehand (JAXQUANT_FFI_LIBRARY, e.g. carried in by the run tool)
  # saves the build's minute and a half; one that does not load is rebuilt.
  if [ -n "${JAXQUANT_FFI_LIBRARY:-}" ] && PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
      "import sys, jaxquant.kernels as k; print('prebuilt library:', k.available(), k.unavailable_reason()); sys.exit(not k.available())"; then
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    return 0
  fi
  unset JAXQUANT_FFI_LIBRARY
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl >"$log" 2>&1 || { tail -20 "$log"; return 1; }
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  python3 -m pip install --no-build-isolation --no-deps --force-reinstall -v . >>"$log" 2>&1
  local status=$?
  echo "pip install: exit $status in $(( $(date +%s) - start )) s"
  if [ $status -ne 0 ]; then tail -40 "$log"; return 1; fi
  # Scripts import the source tree (cwd); point it at the library pip just installed.
  export JAXQUANT_FFI_LIBRARY=$(cd /tmp && python3 -c "import jaxquant.kernels.library as l; print(l.library_path())")
  export PYTHONPATH="$PWD:$PYTHONPATH"
  python3 -c "import jaxquant.kernels as k; print('kernels available:', k.available(), k.unavailable_reason())"
}
