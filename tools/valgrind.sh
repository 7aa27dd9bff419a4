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
# spinning (valgrind runs one thread at a time). Leaks are not checked (CPython keeps
# objects alive until exit; tests/test_resources.py measures growth instead).
#
# No suppressions: every error memcheck reports is classified by its call stack (50
# frames). One with a frame in fastattn's extensions fails the run; the others are
# counted and shown as "outside fastattn": an interpreter built without valgrind
# support reports some in CPython itself, and glibc's dynamic loader some while it
# loads extension modules. When the run fails, the full log is copied to
# valgrind.log in the current directory.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/fastattn-valgrind.XXXXXX")"
trap 'rm -rf "$work"' EXIT
command -v valgrind > /dev/null || { echo "valgrind: not installed"; exit 1; }
python -c "import Cython, setuptools, numpy, pytest, hypothesis" 2> /dev/null || {
    echo "$(basename "$0"): needs Cython, setuptools, numpy, pytest and hypothesis:"
    echo "    pip install 'Cython>=3.1' setuptools '.[test]'"; exit 1; }

log="$work/valgrind.log"
keep="$PWD/valgrind.log"
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
# the interpreter's real executable: valgrind must not stop at a wrapper script (pyenv)
python_exe="$(python -c 'import sys; print(sys.executable)')"
start=$(date +%s)
status=0
valgrind --tool=memcheck --leak-check=no --track-origins=yes --num-callers=50 \
    --log-file="$log" \
    "$python_exe" -m pytest -q -p no:cacheprovider "${subset[@]}" || status=$?
echo "valgrind: pytest under memcheck exited with $status after $(( $(date +%s) - start )) s"
grep -q "Memcheck" "$log" || { echo "valgrind: memcheck did not run"; exit 1; }

python - "$log" <<'PY' || status=99
import re, sys
from collections import Counter
text = open(sys.argv[1]).read()
lines = [re.sub(r"^==\d+== ?", "", l) for l in text.splitlines()]
blocks, cur = [], None
for line in lines:
    if re.match(r"(Invalid |Use of uninit|Conditional jump|Syscall param|Mismatched|"
                r"Source and destination|Argument '|Process terminating)", line):
        cur = [line]
        blocks.append(cur)
    elif cur is not None and line.strip():
        cur.append(line)
    else:
        cur = None
ours = re.compile(r"__pyx_|/fastattn/|_drivers\.c|_backward\.c|kernels\.c|_openmp\.c")
mine = [b for b in blocks if any(ours.search(l) for l in b)]
other = Counter(f"{b[0]}  at {b[1].split(': ', 1)[-1] if len(b) > 1 else '?'}"
                for b in blocks if b not in mine)
print("\n".join(re.findall(r"ERROR SUMMARY.*", text)))
print(f"valgrind: {len(mine)} error contexts in fastattn, "
      f"{len(blocks) - len(mine)} outside it:")
for what, n in other.most_common():
    print(f"  {n:3d} x {what}")
for b in mine:
    print("\n".join(["IN FASTATTN:"] + b[:30]))
sys.exit(1 if mine else 0)
PY
[ $status -eq 0 ] || cp "$log" "$keep"
exit $status
