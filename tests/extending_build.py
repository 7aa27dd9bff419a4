"""Build small Cython extensions against the fastattn under test.

Used by the tests of the public C-level API (``fastattn/kernels.pxd``) and by the
README test, which builds the C-level API example exactly as the README shows it. A
build runs ``setup.py build_ext --inplace`` in a subprocess, in a temporary folder, with
the compiler that Python (and so fastattn) was built with, and with fastattn's own
compile flags (OpenMP included) when its build recorded them.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

import fastattn

# The folder that holds the `fastattn` package: Cython finds fastattn/kernels.pxd there.
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))

SETUP_TEMPLATE = textwrap.dedent("""
    from setuptools import Extension, setup
    from Cython.Build import cythonize

    flags = {flags!r}
    setup(ext_modules=cythonize(
        [Extension({name!r}, [{source!r}], extra_compile_args=flags["compile"],
                   extra_link_args=flags["link"])],
        include_path=[{include!r}], language_level=3, quiet=True))
""")

_compiler_checked: list = []


def build_flags() -> dict:
    """fastattn's own compile and link flags, or just OpenMP's when it has none."""
    try:
        from fastattn import _build_config
        return {"compile": list(_build_config.COMPILE_ARGS),
                "link": list(_build_config.LINK_ARGS)}
    except ImportError:
        from fastattn import _openmp
        flag = ["-fopenmp"] if _openmp.openmp_enabled() and os.name != "nt" else []
        return {"compile": flag, "link": flag}


def require_toolchain() -> None:
    """Skip the calling test when Cython or a working C compiler is missing."""
    pytest.importorskip("Cython", reason="Cython is needed to build an extension")
    pytest.importorskip("setuptools", reason="setuptools is needed to build an extension")
    if not _compiler_checked:
        from setuptools._distutils.ccompiler import new_compiler
        from setuptools._distutils.sysconfig import customize_compiler
        compiler = new_compiler()
        customize_compiler(compiler)
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "probe.c")
            Path(src).write_text("int probe(void) { return 0; }\n")
            try:
                compiler.compile([src], output_dir=tmp)
                _compiler_checked.append(True)
            except Exception as exc:                    # noqa: BLE001
                _compiler_checked.append(f"no working C compiler: {exc}")
    if _compiler_checked[0] is not True:
        pytest.skip(_compiler_checked[0])


def build_env() -> dict:
    """The environment of a build: fastattn under test comes first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [PACKAGE_PARENT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def run_setup(workdir: Path, timeout: float = 600) -> None:
    """``python setup.py build_ext --inplace`` in workdir; fail with its output."""
    res = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"],
                         cwd=workdir, env=build_env(), capture_output=True, text=True,
                         timeout=timeout)
    if res.returncode != 0:
        pytest.fail(f"building the extension failed:\n{res.stdout[-4000:]}\n"
                    f"{res.stderr[-4000:]}")


def load_module(name: str, workdir: Path):
    """Import the extension module `name` built in workdir."""
    paths = [p for p in workdir.iterdir()
             if p.name.startswith(name + ".") and p.suffix in (".so", ".pyd")]
    assert paths, f"no built module {name} in {workdir}"
    spec = importlib.util.spec_from_file_location(name, paths[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_extension(workdir: Path, name: str, source: Path):
    """Build the Cython file `source` as the extension `name` in workdir; import it."""
    require_toolchain()
    workdir.mkdir(parents=True, exist_ok=True)
    pyx = workdir / f"{name}.pyx"
    pyx.write_text(Path(source).read_text())
    (workdir / "setup.py").write_text(SETUP_TEMPLATE.format(
        flags=build_flags(), name=name, source=pyx.name, include=PACKAGE_PARENT))
    run_setup(workdir)
    return load_module(name, workdir)


_built: dict = {}


@pytest.fixture(scope="session")
def consumer(tmp_path_factory):
    """tests/extending/consumer.pyx built against fastattn's public C-level API.

    Import this fixture into a test module to use it. Skips when Cython or a C
    compiler is missing; built once per test session, whichever module asks first.
    """
    if "consumer" not in _built:
        source = Path(__file__).parent / "extending" / "consumer.pyx"
        _built["consumer"] = build_extension(tmp_path_factory.mktemp("consumer"),
                                             "fastattn_consumer", source)
    return _built["consumer"]
