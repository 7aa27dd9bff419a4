#!/usr/bin/env bash
# Run a small representative subset of the tests under valgrind's memcheck.
#
#   tools/valgrind.sh                 # the default subset below
#   tools/valgrind.sh tests/...       # any pytest arguments instead
#
# The extensions are built normally (-O3, OpenMP) plus -g, in a temporary copy of the
# sources (the working tree is left alone). PYTHONMALLOC=malloc makes CPython use
# malloc for every object, so that memcheck sees each allocation; the fuzz tests run
# FASTATTN_FUZZ_EXAMPLES (default 15) examples each; OpenMP threads sleep instead of
# spinning (valgrind runs one thread at a time). Any memcheck error fails the run
# (--error-exitcode); leaks are not checked (CPython keeps objects alive until exit;
# tests/test_resources.py measures growth instead). tools/valgrind-python.supp holds
# suppressions for CPython itself only.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/fastattn-valgrind.XXXXXX")"
trap 'rm -rf "$work"' EXIT
command -v valgrind > /dev/null || { echo "valgrind: not installed"; exit 1; }

cd "$root"
cp -r setup.py pyproject.toml README.md LICENSE fastattn tests "$work"/
rm -rf "$work"/fastattn/*.so "$work"/fastattn/*.c "$work"/fastattn/_build_config.py
find "$work" -name __pycache__ -prune -exec rm -rf {} +
cd "$work"
echo "valgrind: building with -g in $work"
FASTATTN_CFLAGS="-g" python setup.py build_ext --inplace --force -q > build.log 2>&1 \
    || { cat build.log; exit 1; }

subset=(
    tests/test_kernels.py
    tests/test_numerics.py
    tests/test_errors.py
    "tests/test_attention.py::test_shapes"
    "tests/test_attention.py::test_causal"
    tests/test_fuzz.py
    "tests/test_threads.py::test_concurrent_calls_give_the_single_threaded_results"
    "tests/test_resources.py::test_absurd_sizes_raise"
    "tests/test_resources.py::test_empty_results_with_absurd_row_counts_return_at_once"
)
[ $# -gt 0 ] && subset=("$@")

export PYTHONPATH="$work${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONMALLOC=malloc FASTATTN_SANITIZED=1 OMP_WAIT_POLICY=passive OMP_NUM_THREADS=2
export FASTATTN_FUZZ_EXAMPLES="${FASTATTN_FUZZ_EXAMPLES:-15}"
start=$(date +%s)
status=0
valgrind --tool=memcheck --error-exitcode=99 --leak-check=no --track-origins=yes \
    --suppressions="$root/tools/valgrind-python.supp" --log-file=valgrind.log \
    python -m pytest -q -p no:cacheprovider "${subset[@]}" || status=$?
echo "valgrind: pytest under memcheck exited with $status after $(( $(date +%s) - start )) s"
grep -E "ERROR SUMMARY|Invalid|uninitialised|definitely" valgrind.log | sort | uniq -c | head -40
[ $status -eq 0 ] || cp valgrind.log "$root/valgrind-failure.log"
exit $status
