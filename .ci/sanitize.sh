#!/usr/bin/env bash
# The sanitizer run: build simdnorm with -fsanitize=address,undefined (CMake option SIMDNORM_SANITIZE,
# its own build dir build/sanitize) into its own fresh virtual environment, then run the test suite
# (all of tests/ but the benchmark harness and the slow tests) with the ASan runtime preloaded into
# Python. Fails on any sanitizer report, in pytest's process or in any subprocess a test starts, and
# also when the self-test (tests/sanitize/asan_canary.py) is NOT caught. See docs/RELIABILITY.md.
#
# Environment: SIMDNORM_SANITIZE_TESTS  pytest arguments instead of the default selection
#              SIMDNORM_SANITIZE_KEEP=1 keep the work directory (venv, reports) for inspection
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
stamp() { echo "[sanitize +$(( $(date +%s) - t0 ))s] $*"; }

cxx="${CXX:-g++}"
asan_lib="$("$cxx" -print-file-name=libasan.so)"
ubsan_lib="$("$cxx" -print-file-name=libubsan.so)"
for lib in "$asan_lib" "$ubsan_lib"; do
  if [[ "$lib" != /* || ! -e "$lib" ]]; then
    echo "sanitize: $cxx does not know where its sanitizer runtime is ($lib); install its libasan/libubsan" >&2
    exit 2
  fi
done

work="$(mktemp -d)"
cleanup() { if [[ "${SIMDNORM_SANITIZE_KEEP:-0}" != 1 ]]; then rm -rf "$work"; else echo "kept $work"; fi; }
trap cleanup EXIT
venv="$work/venv"
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install --quiet --upgrade pip

stamp "building the sanitized package (build dir build/sanitize)"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
"$py" -m pip install --quiet ".[test]" \
  -Ccmake.define.SIMDNORM_SANITIZE=ON -Cbuild-dir=build/sanitize
stamp "built"

reports="$work/reports"
mkdir -p "$reports" "$work/canary"
# detect_leaks=0: CPython leaks by design. allocator_may_return_null: a huge np.empty must raise
# MemoryError as without ASan, not abort. Reports go to files (one per process) so that a report in a
# subprocess that a test swallowed still fails the run.
asan_common="detect_leaks=0:halt_on_error=1:abort_on_error=0:allocator_may_return_null=1"
ubsan_common="halt_on_error=1:print_stacktrace=1"
run_sanitized() {  # run_sanitized REPORT_DIR command...
  local dir="$1"
  shift
  LD_PRELOAD="$asan_lib:$ubsan_lib" \
  ASAN_OPTIONS="$asan_common:log_path=$dir/asan" \
  UBSAN_OPTIONS="$ubsan_common:log_path=$dir/ubsan" \
  SIMDNORM_SANITIZED_RUN=1 \
    "$@"
}

# 1. self-test: a read and a write past a heap buffer must be reported
for which in read write; do
  set +e
  run_sanitized "$work/canary" "$py" tests/sanitize/asan_canary.py "$which" >"$work/canary/$which.out" 2>&1
  rc=$?
  set -e
  if [[ $rc -eq 0 ]] || ! grep -qs "heap-buffer-overflow" "$work"/canary/asan.*; then
    echo "sanitize: the ASan self-test ($which past a heap buffer) was NOT caught (exit $rc):" >&2
    cat "$work/canary/$which.out" "$work"/canary/asan.* >&2 2>/dev/null || true
    echo "the sanitizer run would prove nothing: is the extension built with SIMDNORM_SANITIZE=ON?" >&2
    exit 1
  fi
  rm -f "$work"/canary/asan.* "$work"/canary/ubsan.*
done
stamp "self-test: ASan caught the canary read and write"

# 2. the suite under the sanitizers
if [[ -n "${SIMDNORM_SANITIZE_TESTS:-}" ]]; then
  read -r -a args <<<"$SIMDNORM_SANITIZE_TESTS"
else
  args=(tests -m "not slow" --ignore=tests/test_bench_harness.py --ignore=tests/sanitize)
fi
stamp "pytest ${args[*]}"
set +e
run_sanitized "$reports" "$py" -m pytest -p no:cacheprovider -q "${args[@]}"
rc=$?
set -e
shopt -s nullglob
found=("$reports"/*)
if (( ${#found[@]} )); then
  echo "sanitize: ${#found[@]} sanitizer report(s):" >&2
  for f in "${found[@]}"; do
    echo "===== $f" >&2
    cat "$f" >&2
  done
  rc=1
fi
stamp "done (pytest and reports: exit $rc)"
exit $rc
