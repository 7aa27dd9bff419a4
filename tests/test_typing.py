"""Type information: py.typed, .pyi stubs that match the runtime (mypy.stubtest), and a
small example that `mypy --strict` accepts, beside misuses it must reject."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fastattn

HERE = Path(__file__).parent / "typing"
PACKAGE = Path(fastattn.__file__).parent
PACKAGE_PARENT = str(PACKAGE.parent)


def mypy_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [PACKAGE_PARENT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("MYPYPATH", None)
    return env


def run_mypy(args, tmp_path):
    pytest.importorskip("mypy", reason="mypy is needed to check the types")
    # mypy runs outside the source tree, so that it finds one fastattn only
    return subprocess.run([sys.executable, "-m", *args], cwd=tmp_path, env=mypy_env(),
                          capture_output=True, text=True, timeout=600)


def test_package_is_marked_typed():
    assert (PACKAGE / "py.typed").is_file()
    compiled = [p.stem for p in PACKAGE.glob("*.pyx")]
    assert "kernels" in compiled
    for name in ["_api", "_config", "reference", *compiled]:
        assert (PACKAGE / f"{name}.pyi").is_file(), f"fastattn/{name}.pyi is missing"


# modules that need optional dependencies: checked only where they are installed
OPTIONAL = {"fastattn.dask": ("dask",), "fastattn.torch": ("torch",),
            "fastattn.integrations.transformers": ("torch", "transformers")}
# PyTorch is not loaded under the sanitizer build (tools/sanitize.sh): its own native
# code does not run with ASan preloaded into an uninstrumented interpreter
NOT_SANITIZED = ("torch", "transformers")


def runnable(name):
    """False for a module stubtest must not import here: one whose optional dependency
    is missing (or is PyTorch under the sanitizer build), or a driver module built for
    an instruction-set level this CPU lacks (importing it could stop the process with
    SIGILL)."""
    for dependency in OPTIONAL.get(name, ()):
        if importlib.util.find_spec(dependency) is None:
            return False
        if dependency in NOT_SANITIZED and os.environ.get("FASTATTN_SANITIZED"):
            return False
    level = re.fullmatch(r"fastattn\._drivers_(\w+)", name)
    if level is None:
        return True
    try:
        from fastattn import _cpu
    except ImportError:
        return True
    return level.group(1) in _cpu.supported_levels()


def module_name(stub):
    """``fastattn.cli.bench.grid`` for fastattn/cli/bench/grid.pyi (``fastattn.cli``
    for fastattn/cli/__init__.pyi)."""
    parts = stub.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("fastattn",) + parts)


def test_stubs_match_the_runtime(tmp_path):
    """mypy.stubtest imports every module that has a stub, in the package and its
    subpackages, and compares the two."""
    modules, orphans = [], []
    # a stub that other stubs link to (the per-level driver modules share one) is
    # checked through each of its links; an installed package holds copies of the
    # links, so there a stub without a module whose text another stub repeats is the
    # shared one
    shared = {(link.parent / link.readlink()).resolve()
              for link in PACKAGE.rglob("*.pyi") if link.is_symlink()}
    copies = {}
    for stub in PACKAGE.glob("*.pyi"):
        copies.setdefault(stub.read_bytes(), []).append(stub)
    shared |= {stub.resolve() for group in copies.values() if len(group) > 1
               for stub in group
               if importlib.util.find_spec(f"fastattn.{stub.stem}") is None}
    for stub in sorted(PACKAGE.rglob("*.pyi")):
        name = module_name(stub)
        if stub.resolve() in shared and not stub.is_symlink():
            continue
        if importlib.util.find_spec(name) is not None:
            if runnable(name):
                modules.append(name)
        elif not stub.with_suffix(".pyx").is_file():
            orphans.append(str(stub.relative_to(PACKAGE)))
        # else: a compiled module this platform does not build (e.g. one ISA level)
    assert not orphans, f"stubs without a module: {orphans}"
    # stubtest checks a package together with its submodules: name each module once
    modules = [m for m in modules if not any(m.startswith(p + ".") for p in modules)]
    config = tmp_path / "mypy.ini"
    # only the stubbed modules are checked; modules they import are followed silently
    config.write_text("[mypy]\nfollow_imports = silent\n")
    res = run_mypy(["mypy.stubtest", *modules, "--mypy-config-file", str(config),
                    "--allowlist", str(HERE / "stubtest-allowlist.txt")], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr


def test_mypy_strict_accepts_the_example_and_rejects_misuse(tmp_path):
    good, bad = HERE / "example.py", HERE / "example_errors.py"
    res = run_mypy(["mypy", "--strict", "--no-pretty", "--hide-error-context",
                    "--no-error-summary", "--cache-dir", str(tmp_path / "cache"),
                    str(good), str(bad)], tmp_path)
    errors = re.findall(r"^(.*?):(\d+): error:", res.stdout, flags=re.M)
    in_good = [line for path, line in errors if Path(path).name == good.name]
    in_bad = {int(line) for path, line in errors if Path(path).name == bad.name}
    assert not in_good, res.stdout[-3000:]
    expected = {n for n, line in enumerate(bad.read_text().splitlines(), 1)
                if re.search(r"#\s*E:", line)}
    report = "\n".join(line for line in res.stdout.splitlines() if ": error:" in line)
    assert expected and in_bad == expected, report


def test_the_typed_example_runs():
    sys.path.insert(0, str(HERE))
    try:
        import example
        assert example.main() < 1e-4
    finally:
        sys.path.remove(str(HERE))
        sys.modules.pop("example", None)
