#!/usr/bin/env bash
# Build fastattn with AddressSanitizer + UndefinedBehaviorSanitizer and run the tests
# under it.
#
#   tools/sanitize.sh                       # the whole test suite
#   tools/sanitize.sh tests/test_fuzz.py    # any pytest arguments: a subset
#
# The build happens in a temporary copy of the sources (the working tree and its
# normal build are left alone) with FASTATTN_SANITIZE=1, which compiles the
# extensions with -fsanitize=address,undefined -fno-sanitize-recover=undefined -O1 -g.
# The interpreter itself is not instrumented, so gcc's ASan runtime is preloaded.
#
# ASAN_OPTIONS:
#   detect_leaks=0               CPython keeps many allocations alive until exit (and
#                                some for ever), so LeakSanitizer reports are noise; leaks
#                                are checked by tests/test_resources.py (RSS) instead.
#   allocator_may_return_null=1  an absurd allocation returns NULL (NumPy then raises
#                                MemoryError, as tests/test_resources.py expects) instead
#                                of ASan stopping the process.
#   abort_on_error=1             any error stops the run with a report and a failure.
# UBSAN_OPTIONS: halt_on_error=1, print_stacktrace=1 (undefined behaviour is fatal).
#
# FASTATTN_SANITIZE_AMX=1 builds the AMX kernels with C functions standing in for the
# tile instructions (-DFA_AMX_EMULATE) and turns them on (FASTATTN_ISA=amx): every
# tile load and store is then a checked memory access, on any AVX512-BF16 CPU
# (elsewhere the AMX tests skip).
#
# FASTATTN_SANITIZE_AMX_TESTS="tests/a.py tests/b.py" makes the same build but leaves
# the emulated kernels off (an emulated build uses them only where FASTATTN_ISA=amx
# asks) for the tests given as arguments, and runs the files it names with them on,
# beside those, from the one build (CI's two instrumented stages: one build instead of
# two). Their output follows; either run's failure fails the script.
#
# FASTATTN_SANITIZED=1 tells the tests that memory numbers (ASan's quarantine holds
# freed memory) and address-space limits (ASan's shadow needs terabytes) do not apply.
# Needs gcc with libasan/libubsan; Linux.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/fastattn-sanitize.XXXXXX")"
trap 'rm -rf "$work"' EXIT

python -c "import Cython, setuptools, numpy, pytest, hypothesis" 2> /dev/null || {
    echo "$(basename "$0"): needs Cython, setuptools, numpy, pytest and hypothesis:"
    echo "    pip install 'Cython>=3.1' setuptools '.[test]'"; exit 1; }

cd "$root"
# (a test run in the tree may be writing its __pycache__ folders: they are not read)
tar -cf - --exclude=__pycache__ setup.py pyproject.toml README.md LICENSE fastattn tests \
    tools | tar -xf - -C "$work"
rm -rf "$work"/fastattn/*.so "$work"/fastattn/*.c "$work"/fastattn/_build_config.py
cd "$work"

echo "sanitize: building with ASan + UBSan in $work"
start=$(date +%s)
amx_tests="${FASTATTN_SANITIZE_AMX_TESTS:-}"
if [ "${FASTATTN_SANITIZE_AMX:-0}" = 1 ] || [ -n "$amx_tests" ]; then
    export FASTATTN_CFLAGS="${FASTATTN_CFLAGS:-} -DFA_AMX_EMULATE"
    [ -n "$amx_tests" ] || export FASTATTN_ISA=amx
    echo "sanitize: with the AMX kernels emulated"
fi
FASTATTN_SANITIZE=1 python setup.py build_ext --inplace --force -q > build.log 2>&1 \
    || { cat build.log; exit 1; }
echo "sanitize: built in $(( $(date +%s) - start )) s"

libasan="$(gcc -print-file-name=libasan.so)"
[ -e "$libasan" ] || { echo "sanitize: gcc's libasan.so not found"; exit 1; }

export PYTHONPATH="$work${PYTHONPATH:+:$PYTHONPATH}"
export FASTATTN_SANITIZED=1
export ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:abort_on_error=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
grep -q -- "-fsanitize=address" fastattn/_build_config.py \
    || { echo "sanitize: the build is not instrumented"; exit 1; }

# --capture=sys: reports written straight to file descriptor 2 reach the console
run_tests() { LD_PRELOAD="$libasan" python -m pytest -q -p no:cacheprovider --capture=sys "$@"; }

start=$(date +%s)
if [ -n "$amx_tests" ]; then   # (its own temporary folder: no pytest clears another's)
    mkdir "$work/amx-tmp"
    # shellcheck disable=SC2086
    (TMPDIR="$work/amx-tmp" FASTATTN_ISA=amx run_tests $amx_tests > "$work/amx.log" 2>&1) &
    amx_pid=$!
fi
status=0
run_tests "${@:-tests}" || status=$?
echo "sanitize: pytest exited with $status after $(( $(date +%s) - start )) s"
if [ -n "$amx_tests" ]; then
    amx_status=0
    wait "$amx_pid" || amx_status=$?
    echo "sanitize: beside it, with the AMX kernels emulated (FASTATTN_ISA=amx): $amx_tests"
    cat "$work/amx.log"
    echo "sanitize: that pytest exited with $amx_status after $(( $(date +%s) - start )) s"
    [ "$status" != 0 ] || status=$amx_status
fi
exit $status
