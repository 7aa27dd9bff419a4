#!/usr/bin/env bash
# Check the release artefacts end to end, as a user would meet them:
#
#   1. `python -m build` makes the sdist, then builds the wheel FROM that sdist (so the
#      sdist is proved to build on its own, in an isolated environment);
#   2. the sdist holds the Cython sources (.pyx, .pxd), stubs, tests and no generated C;
#      the wheel holds the compiled modules, kernels.pxd, the stubs and py.typed;
#   3. the wheel is installed with its test extras (those of the README's test command,
#      or CHECK_WHEEL_EXTRAS) into a fresh virtual environment, and
#      the test suite shipped in the sdist (or the test files named, e.g.
#      tests/test_imports.py) runs against it from outside any source tree.
#
# Usage: tools/check-wheel.sh [test files]   (PYTHON=python3.12 tools/check-wheel.sh ...)
# Takes a few minutes: two isolated builds, one venv, one test run. FASTATTN_ISA_LEVELS
# (e.g. avx2) builds the wheel with those driver levels only (and baseline).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/fastattn-check-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT
export FASTATTN_REQUIRE_OPENMP=${FASTATTN_REQUIRE_OPENMP:-1}
say() { printf '\ncheck-wheel: [%d s] %s\n' "$SECONDS" "$*"; }    # seconds since the start

cd "$work"              # never the source tree: its build/ folder is not the 'build' package
builder=$python
if ! "$python" -c "import build.__main__" 2>/dev/null; then
    say "installing 'build' into a scratch environment ($python has no 'build')"
    "$python" -m venv "$work/build-env"
    builder="$work/build-env/bin/python"
    [ -x "$builder" ] || builder="$work/build-env/Scripts/python.exe"
    "$builder" -m pip install --quiet build
fi

say "building the sdist and, from it, the wheel"
"$builder" -m build --outdir "$work/dist" "$root"
sdist=$(ls "$work"/dist/fastattn-*.tar.gz)
wheel=$(ls "$work"/dist/fastattn-*.whl)
echo "  $(basename "$sdist")"
echo "  $(basename "$wheel")"

say "checking what the sdist and the wheel contain"
"$python" - "$sdist" "$wheel" "$root" <<'PY'
import glob, os, sys, tarfile, zipfile

sdist, wheel, root = sys.argv[1:]
sources = sorted(os.path.relpath(p, root).replace(os.sep, "/")
                 for ext in ("pyx", "pxd", "pxi", "pyi", "h")
                 for p in glob.glob(os.path.join(root, "fastattn", "**", f"*.{ext}"),
                                    recursive=True))
compiled = [os.path.basename(p)[:-4] for p in sources if p.endswith(".pyx")]
with tarfile.open(sdist) as tar:
    names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
with zipfile.ZipFile(wheel) as whl:
    wnames = set(whl.namelist())
    entry_points = next((whl.read(n).decode() for n in wnames
                         if n.endswith(".dist-info/entry_points.txt")), "")
    metadata = next(whl.read(n).decode() for n in wnames
                    if n.endswith(".dist-info/METADATA"))

problems = []
def need(found, what):
    if not found:
        problems.append(what)

# every Cython source, include file, C header and stub of the source tree (the
# headers too: a build of fewer levels, FASTATTN_ISA_LEVELS, may not include them all)
for name in ["setup.py", "pyproject.toml", "README.md", "LICENSE", "MANIFEST.in",
             "fastattn/py.typed", "tests/conftest.py", "tests/extending/consumer.pyx",
             "docs/conf.py", "docs/index.md",
             *sources]:
    need(name in names, f"sdist lacks {name}")
need("fastattn/kernels.pxd" in sources, "the source tree lacks fastattn/kernels.pxd")
need(not [n for n in names if n.endswith((".c", ".so", ".pyd"))],
     "sdist holds generated C or compiled modules")
need(not [n for n in names if n.endswith("_build_config.py")],
     "sdist holds a _build_config.py from a local build")

for name in ["fastattn/__init__.py", "fastattn/kernels.pxd", "fastattn/py.typed",
             "fastattn/_api.pyi", "fastattn/kernels.pyi", "fastattn/_build_config.py",
             "fastattn/cli/__init__.py", "fastattn/cli/bench/__init__.py",
             "fastattn/torch.pyi", "fastattn/integrations/__init__.py",
             "fastattn/integrations/transformers.py",
             "fastattn/integrations/transformers.pyi",
             *[p for p in sources if p.endswith(".pyi")]]:
    need(name in wnames, f"wheel lacks {name}")
def built(module):
    return [n for n in wnames if n.startswith(f"fastattn/{module}.")
            and n.endswith((".so", ".pyd"))]
# a compiled module for every .pyx (the drivers of some instruction-set levels are
# only built where the compiler targets x86-64; the baseline one always)
for module in compiled:
    need(built(module) or (module.startswith("_drivers_")
                           and module != "_drivers_baseline"),
         f"wheel lacks the compiled {module}")
need(not [n for n in wnames if n.endswith(".c")], "wheel holds generated C")
need("fastattn = fastattn.cli:main" in entry_points, "wheel lacks the console script")
for field in ["Summary:", "License-Expression:", "Requires-Python:",
              "Requires-Dist: numpy", "Provides-Extra: test", "Provides-Extra: bench",
              "Provides-Extra: plot", "Provides-Extra: dask", "Provides-Extra: torch",
              "Provides-Extra: docs",
              "Classifier: Typing :: Typed"]:
    need(field in metadata, f"wheel metadata lacks {field}")

if problems:
    sys.exit("check-wheel: " + "\ncheck-wheel: ".join(problems))
print(f"  sdist: {len(names)} files; wheel: {len(wnames)} files; contents OK")
PY

# the extras: CHECK_WHEEL_EXTRAS (e.g. [test,bf16]), else those of the README's test
# command (the one CI runs), e.g. [test,dask]
extras=${CHECK_WHEEL_EXTRAS:-$(grep -m1 -E '^pip install "\.\[test' "$root/README.md" \
                                | sed -E 's/^pip install "\.(\[[^]]*\])".*/\1/')}
extras=${extras:-[test]}
say "installing the wheel with the extras $extras into a fresh virtual environment"
"$python" -m venv "$work/venv"
venv_python="$work/venv/bin/python"
[ -x "$venv_python" ] || venv_python="$work/venv/Scripts/python.exe"
"$venv_python" -m pip install --quiet "$wheel$extras"

# the named test files, taken from the sdist's copy of the tests (all of them by default)
tests=()
for t in "$@"; do tests+=("$work/src/$t"); done
[ ${#tests[@]} -gt 0 ] || tests=("$work/src/tests")
say "running the sdist's tests against the installed wheel: ${*:-the whole suite}"
mkdir -p "$work/src" "$work/run"
tar -xzf "$sdist" -C "$work/src" --strip-components=1
cd "$work/run"          # outside any source tree: `import fastattn` is the wheel
"$venv_python" - <<'PY'
import fastattn, sys
assert "site-packages" in fastattn.__file__, fastattn.__file__
print(f"  fastattn {fastattn.__version__} from {fastattn.__file__}")
PY
"$work/venv/bin/fastattn" info
"$venv_python" -m pytest -q -p no:cacheprovider --rootdir "$work/src" "${tests[@]}"

say "OK: the sdist builds on its own, the wheel installs and its tests pass"
