#!/usr/bin/env bash
# The sanitizer run: build simdnorm with -fsanitize=address,undefined (CMake option SIMDNORM_SANITIZE,
# its own build dir build/sanitize; of the ISA units this CPU runs, the widest instrumented and the
# x86 fallback not, CMakeLists.txt) into its own fresh virtual environment, then run the test suite
# (the files that reach the kernels, without the slow tests) with the ASan runtime preloaded into
# Python. Fails on any sanitizer report (ASan reports are written to one file per process, so one in
# a subprocess that a test starts counts too; UBSan's go to stderr, which is scanned), on any test
# failure, and when the self-test (tests/sanitize/asan_canary.py) is NOT caught. See
# docs/RELIABILITY.md.
#
# Environment: SIMDNORM_SANITIZE_TESTS  test files to run instead of those (space-separated; slow
#                                       tests never run)
#              SIMDNORM_SANITIZE_JOBS   test files run at once (default: the number of cores)
#              SIMDNORM_SANITIZE_KEEP=1 keep the work directory (venv, reports) for inspection
#              SIMDNORM_SANITIZE_PHASE  "build": only build into SIMDNORM_SANITIZE_WORK; "test": only
#                                       the tests, on what that build left there (.ci/run builds
#                                       while the plain suite runs on one core); default both
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

phase="${SIMDNORM_SANITIZE_PHASE:-all}"
if [[ "$phase" != all ]]; then
  work="${SIMDNORM_SANITIZE_WORK:?SIMDNORM_SANITIZE_PHASE needs SIMDNORM_SANITIZE_WORK}"
  mkdir -p "$work"
else
  work="$(mktemp -d)"
fi
cleanup() { if [[ "${SIMDNORM_SANITIZE_KEEP:-0}" != 1 ]]; then rm -rf "$work"; else echo "kept $work"; fi; }
if [[ "$phase" != build ]]; then trap cleanup EXIT; fi
venv="$work/venv"
py="$venv/bin/python"
build_sanitized() {  # the sanitized package, into its own venv in $work
  python3 -m venv "$venv"
  "$py" -m pip install --quiet --upgrade pip

  # Only the ISA units this CPU runs (the build's default, SIMDNORM_ISAS=host): the suite could run
  # no other unit's kernels here, and instrumented they are most of the build's time. Of those the
  # widest is instrumented (avx512, not avx512bf16, whose loops are its own) and the suite runs it
  # (SIMDNORM_SANITIZED_RUN, tests/cases.py); the x86 fallback compiles without the sanitizers.
  stamp "building the sanitized package (build dir build/sanitize; the widest ISA unit instrumented)"
  export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
  # scikit-build-core gives `cmake --version` (and ninja's) 5 seconds, four times that under CI=1:
  # niced behind the suite on both cores, a probe through pyenv's shims (bash, then Python) once
  # took longer, and the build found no CMake.
  export CI="${CI:-1}"
  # RelWithDebInfo and no install strip: pybind11 strips Release modules, and reports need symbols
  # (the SIMDNORM_SANITIZE flags come after the build type's and set -O1 -g1)
  "$py" -m pip install --quiet ".[test]" \
    -Ccmake.define.SIMDNORM_SANITIZE=ON -Cbuild-dir=build/sanitize -Ccmake.build-type=RelWithDebInfo \
    -Cinstall.strip=false
  stamp "built"
}
if [[ "$phase" != test ]]; then build_sanitized; fi
if [[ "$phase" == build ]]; then exit 0; fi
if [[ ! -x "$py" ]]; then
  echo "sanitize: no sanitized build in $work (SIMDNORM_SANITIZE_PHASE=build first)" >&2
  exit 2
fi

reports="$work/reports"
mkdir -p "$reports" "$work/canary"
# detect_leaks=0: CPython leaks by design. allocator_may_return_null: a huge np.empty must raise
# MemoryError as without ASan, not abort. Reports go to files (one per process) so that a report in a
# subprocess that a test swallowed still fails the run.
asan_common="detect_leaks=0:halt_on_error=1:abort_on_error=0:allocator_may_return_null=1"
ubsan_common="halt_on_error=1:print_stacktrace=1"
symbolizer="$(command -v llvm-symbolizer || command -v addr2line || true)"
if [[ -n "$symbolizer" ]]; then  # stack frames with function, file and line
  asan_common+=":external_symbolizer_path=$symbolizer"
  ubsan_common+=":external_symbolizer_path=$symbolizer"
fi
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

# 2. the suite under the sanitizers, one pytest process per test file, as many at once as there are
# cores: a report aborts its process (halt_on_error), and the other files still run and report.
# --capture=sys: the runtime writes a report to file descriptor 2; with pytest's default fd-level
# capture it would vanish with the aborted test. stderr goes to a file that is scanned afterwards.
if [[ -n "${SIMDNORM_SANITIZE_TESTS:-}" ]]; then
  read -r -a groups <<<"$SIMDNORM_SANITIZE_TESTS"
else
  # The files that take longest under the sanitizers first, so that the files run side by side end
  # together rather than one long file running alone at the end. Not the files whose own code is
  # Python alone (the bench harness, Dask's chunking, the typing stubs and mypy): the kernels they
  # call run under the other files. Nor the fuzzer's pinned repros (test_crash_repros.py: a child
  # process each, most of their time an instrumented interpreter's start): the plain suite runs
  # them, and their layouts' kernels run here under test_layouts.py and the fuzzer's own test.
  groups=()
  for f in tests/test_layouts.py tests/test_training.py tests/test_threads_isa.py; do
    if [[ -e "$f" ]]; then groups+=("$f"); fi
  done
  left_out=" tests/test_bench_harness.py tests/test_dask.py tests/test_dask_distributed.py tests/test_typing.py \
tests/test_stub.py tests/test_crash_repros.py "
  # Nor, where the sanitized venv has no PyTorch (its test extra does not bring it), the files of
  # the torch path, which would only skip: a process start each under ASan.
  torch_files=0
  "$py" -c "import torch" 2>/dev/null && torch_files=1
  for f in tests/test_*.py; do
    if [[ "$torch_files" == 0 && "$f" == *torch* ]]; then continue; fi
    [[ "$left_out" == *" $f "* || " ${groups[*]} " == *" $f "* ]] || groups+=("$f")
  done
fi
mkdir -p "$work/files"
run_file() {  # run_file INDEX FILE: its stdout, stderr and exit status into $work/files/INDEX.*
  local i="$1" g="$2" r
  set +e
  run_sanitized "$reports" "$py" -m pytest -p no:cacheprovider -q --capture=sys -m "not slow" --durations=15 "$g" \
    >"$work/files/$i.out" 2>"$work/files/$i.err"
  r=$?
  set -e
  echo "$r" >"$work/files/$i.rc"
  stamp "pytest $g: exit $r"
}
jobs_at_once="${SIMDNORM_SANITIZE_JOBS:-$(nproc)}"
for i in "${!groups[@]}"; do
  while (( $(jobs -rp | wc -l) >= jobs_at_once )); do wait -n || true; done
  run_file "$i" "${groups[$i]}" &
done
wait
rc=0
failed=()
: >"$work/stderr.log"
for i in "${!groups[@]}"; do
  cat "$work/files/$i.out"
  cat "$work/files/$i.err" >>"$work/stderr.log"
  r="$(cat "$work/files/$i.rc" 2>/dev/null || echo missing)"
  if [[ "$r" != 0 && "$r" != 5 ]]; then  # 5: nothing collected (a file of slow tests only)
    rc=1
    failed+=("${groups[$i]} (exit $r)")
  fi
done
cat "$work/stderr.log" >&2
shopt -s nullglob
found=("$reports"/*)
if (( ${#found[@]} )); then
  echo "sanitize: ${#found[@]} ASan report file(s):" >&2
  for f in "${found[@]}"; do
    echo "===== $f" >&2
    cat "$f" >&2
  done
  rc=1
fi
if grep -qE "runtime error:|ERROR: AddressSanitizer|SUMMARY: (AddressSanitizer|UndefinedBehaviorSanitizer)" \
    "$work/stderr.log"; then
  echo "sanitize: sanitizer report(s) on stderr:" >&2
  grep -E "runtime error:|ERROR: AddressSanitizer|SUMMARY: " "$work/stderr.log" >&2
  rc=1
fi
if [[ $rc -ne 0 ]]; then
  echo "sanitize: FAILED (a test failed, pytest was aborted by a report, or a report was written)" >&2
  for f in "${failed[@]}"; do echo "  failed: $f" >&2; done
fi
stamp "done (pytest and reports: exit $rc)"
exit $rc
