"""Build the fastattn extensions.

The build probes OpenMP with the real compiler (compile, link and run a tiny program).
Without it the extensions are built serial and a loud warning is printed; with
``FASTATTN_REQUIRE_OPENMP=1`` a missing OpenMP is fatal instead (CI sets it).

Environment switches:

``FASTATTN_REQUIRE_OPENMP=1``  fail the build when OpenMP does not work.
``FASTATTN_DISABLE_OPENMP=1``  build serial on purpose (to test that path).
``FASTATTN_DEBUG_CHECKS=1``    turn Cython's bounds/wraparound/initialised checks on.
``FASTATTN_SANITIZE=1``        build with AddressSanitizer and UBSan (debugging only).
``FASTATTN_CFLAGS``            extra compiler flags appended to every extension.
``FASTATTN_ISA_LEVELS``        comma-separated driver levels to build besides baseline
                               (default: all that the target and compiler support);
                               only those are cythonized; an unknown name stops.
``FASTATTN_BUILD_JOBS``        how many modules to cythonize and compile at once
                               (default: the usable CPUs; ``build_ext -j N`` also sets
                               the compile jobs).

The parallel drivers (``fastattn/_drivers.pxi``) are compiled once per instruction-set
level, as ``_drivers_baseline`` (no instruction-set flags: runs on any CPU of the
target), and on x86 with GCC/Clang also ``_drivers_avx2`` (``-march=x86-64-v3``) and
``_drivers_avx512`` (``-march=x86-64-v4 -mprefer-vector-width=512``).
``fastattn._dispatch`` loads the best one the CPU supports at import time. A level
whose flags the compiler rejects is skipped with a warning. Never ``-march=native``
(the build must run on other machines) nor ``-ffast-math`` (it breaks -inf and NaN).
"""

import glob
import os
import shlex
import subprocess
import sys
import tempfile
import textwrap

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

from Cython.Build import cythonize

import platform

MODULES = ["_openmp", "_cpu", "_plan", "kernels"]

# Driver levels: (name, flags for GCC/Clang). The names match fastattn/_cpu.pyx.
ISA_LEVELS = [
    ("baseline", []),
    ("avx2", ["-march=x86-64-v3"]),
    ("avx512", ["-march=x86-64-v4", "-mprefer-vector-width=512"]),
]

# The AMX kernels (fastattn/src/fa_amx.h) are inline assembly: an assembler that does
# not know the tile instructions (binutils < 2.36) builds the avx512 drivers without them.
AMX_PROBE = "void fa_amx_probe(void) { __asm__ volatile (\"tilerelease\" ::); }\n"

OPENMP_PROBE = textwrap.dedent("""
    #include <omp.h>
    #include <stdio.h>
    int main(void) {
        int n = 0;
        #pragma omp parallel reduction(+:n)
        n += 1;
        printf("%d %d\\n", n, omp_get_max_threads());
        return n >= 1 ? 0 : 1;
    }
""")


def env_flag(name):
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def warn(message):
    bar = "!" * 78
    sys.stderr.write(f"\n{bar}\n{message}\n{bar}\n\n")


def wanted_levels():
    """The driver levels FASTATTN_ISA_LEVELS names, with baseline (always built), or
    None where it is unset: every level the target and compiler support. Only these
    are cythonized and compiled."""
    text = os.environ.get("FASTATTN_ISA_LEVELS", "")
    wanted = {w.strip() for w in text.split(",") if w.strip()}
    if not wanted:
        return None
    known = [name for name, _ in ISA_LEVELS]
    unknown = sorted(wanted - set(known))
    if unknown:
        raise SystemExit(f"FASTATTN_ISA_LEVELS names unknown levels {unknown}: "
                         f"known are {known}")
    return wanted | {"baseline"}


def build_jobs():
    """FASTATTN_BUILD_JOBS, else the CPUs this process may run on."""
    jobs = os.environ.get("FASTATTN_BUILD_JOBS", "").strip()
    if jobs:
        if not jobs.isdigit():
            raise SystemExit(f"FASTATTN_BUILD_JOBS must be a positive integer: {jobs!r}")
        return max(1, int(jobs))
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:      # not on Linux
        return os.cpu_count() or 1


def cythonize_jobs():
    """Processes for cythonize: build_jobs(), or 0 (in this process) where its worker
    processes would run this file again: a start method other than fork imports the
    main script in each worker, and under ``python setup.py`` that is this file.
    Under pip (a build backend runs this file) the main script is the backend's."""
    import multiprocessing
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    if (multiprocessing.get_context().get_start_method() != "fork" and main
            and os.path.abspath(main) == os.path.abspath(__file__)):
        return 0
    jobs = build_jobs()
    return jobs if jobs > 1 else 0


class BuildExt(build_ext):
    """build_ext that probes OpenMP and sets the same flags on every extension, and
    compiles the extensions in parallel (``-j``; default: :func:`build_jobs`)."""

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None and build_jobs() > 1:
            self.parallel = build_jobs()

    def run(self):
        # setuptools clears `inplace` while building and copies the results after.
        self.into_source = bool(self.inplace or getattr(self, "editable_mode", False))
        super().run()

    def openmp_candidates(self):
        if self.compiler.compiler_type == "msvc":
            return [(["/openmp"], [])]
        return [(["-fopenmp"], ["-fopenmp"]),
                (["-Xpreprocessor", "-fopenmp"], ["-lomp"])]   # Apple clang + libomp

    def probe_openmp(self):
        """Return (compile_args, link_args) of a working OpenMP, or None."""
        for compile_args, link_args in self.openmp_candidates():
            with tempfile.TemporaryDirectory() as tmp:
                src = os.path.join(tmp, "probe.c")
                with open(src, "w") as f:
                    f.write(OPENMP_PROBE)
                try:
                    objs = self.compiler.compile([src], output_dir=tmp,
                                                 extra_postargs=compile_args)
                    exe = os.path.join(tmp, "probe")
                    self.compiler.link_executable(objs, exe, extra_postargs=link_args)
                    subprocess.run([exe], check=True, capture_output=True, timeout=60)
                except Exception:                       # noqa: BLE001 - any failure: next
                    continue
            return compile_args, link_args
        return None

    def flags_work(self, flags, source="int fa_isa_probe(int x) { return 2 * x; }\n"):
        """Does the compiler accept these flags (compile a trivial file, or source)?"""
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "isa.c")
            with open(src, "w") as f:
                f.write(source)
            try:
                self.compiler.compile([src], output_dir=tmp, extra_postargs=flags)
            except Exception:                           # noqa: BLE001
                return False
        return True

    def isa_levels(self):
        """{level: flags} of the driver levels to build for this target and compiler."""
        x86 = platform.machine().lower() in ("x86_64", "amd64", "x86", "i386", "i686")
        wanted = wanted_levels()
        levels = {}
        for name, flags in ISA_LEVELS:
            if wanted is not None and name not in wanted:
                continue
            if flags and (not x86 or self.compiler.compiler_type == "msvc"):
                continue
            if flags and not self.flags_work(flags):
                warn(f"fastattn: the compiler rejects {' '.join(flags)}: the {name} "
                     "drivers are not built (the baseline ones are used on such CPUs).")
                continue
            if name == "avx512" and not self.flags_work(flags, AMX_PROBE):
                warn("fastattn: the assembler does not know the AMX instructions: the "
                     "avx512 drivers are built without the AMX kernels.")
                flags = flags + ["-DFA_NO_AMX"]
            levels[name] = flags
        return levels

    def build_extensions(self):
        msvc = self.compiler.compiler_type == "msvc"
        # a call of an undeclared function is an error in gcc >= 14 and clang >= 16:
        # make it one everywhere, so that older compilers catch it too
        compile_args = (["/O2"] if msvc else
                        ["-O3", "-fno-math-errno", "-fno-trapping-math",
                         "-Werror=implicit-function-declaration"])
        link_args = [] if msvc else ["-lm"]
        if env_flag("FASTATTN_SANITIZE") and not msvc:
            san = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer",
                   "-fno-sanitize-recover=undefined", "-O1", "-g"]
            compile_args += san
            link_args += ["-fsanitize=address,undefined"]

        openmp = None
        if env_flag("FASTATTN_DISABLE_OPENMP"):
            warn("fastattn: FASTATTN_DISABLE_OPENMP is set: building WITHOUT OpenMP. "
                 "Every call will run on one thread.")
        else:
            openmp = self.probe_openmp()
            if openmp is None:
                message = ("fastattn: OpenMP does not work with this compiler "
                           f"({self.compiler.compiler_type}). Building WITHOUT OpenMP: "
                           "every call will run on one thread.\n"
                           "On macOS: `brew install libomp`; on Linux: install gcc "
                           "(libgomp) or clang with libomp.")
                if env_flag("FASTATTN_REQUIRE_OPENMP"):
                    raise RuntimeError(message + "\nFASTATTN_REQUIRE_OPENMP is set: "
                                       "stopping.")
                warn(message)
        if openmp is not None:
            compile_args += openmp[0]
            link_args += openmp[1]
        compile_args += shlex.split(os.environ.get("FASTATTN_CFLAGS", ""))

        levels = self.isa_levels()
        kept = cythonized([ext for ext in self.extensions
                           if driver_level(ext) in (None, *levels)])
        for ext in kept:
            isa = levels.get(driver_level(ext), [])
            ext.extra_compile_args = compile_args + isa + list(ext.extra_compile_args)
            ext.extra_link_args = link_args + list(ext.extra_link_args)
        self.extensions[:] = kept

        self.write_build_config(openmp is not None, compile_args, link_args, levels)
        super().build_extensions()

    def write_build_config(self, openmp, compile_args, link_args, levels):
        """Record how the extensions were built, for ``fastattn.show_config()``."""
        targets = [os.path.join(self.build_lib, "fastattn")]
        if self.into_source:
            targets.append(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                        "fastattn"))
        compiler = getattr(self.compiler, "compiler_so", None) or [self.compiler.compiler_type]
        text = ("# Written by setup.py at build time.\n"
                f"OPENMP = {openmp!r}\n"
                f"COMPILER = {compiler[0]!r}\n"
                f"COMPILE_ARGS = {compile_args!r}\n"
                f"LINK_ARGS = {link_args!r}\n"
                f"ISA_FLAGS = {levels!r}\n")
        for target in targets:
            os.makedirs(target, exist_ok=True)
            with open(os.path.join(target, "_build_config.py"), "w") as f:
                f.write(text)


def extensions():
    """The extensions to build, their sources still the .pyx files: BuildExt turns
    into C only those it builds (cythonized), so that making an sdist or reading the
    metadata cythonizes nothing."""
    wanted = wanted_levels()
    names = MODULES + [f"_drivers_{level}" for level, _ in ISA_LEVELS
                       if wanted is None or level in wanted]
    depends = sorted(glob.glob("fastattn/*.pxd") + glob.glob("fastattn/*.pxi")
                     + glob.glob("fastattn/src/*.h"))
    return [Extension(f"fastattn.{name}", [f"fastattn/{name}.pyx"],
                      include_dirs=["fastattn/src"], depends=depends)
            for name in names]


def driver_level(ext):
    """The instruction-set level of a drivers extension, None for the other modules."""
    return ext.name.rpartition("._drivers_")[2] if "._drivers_" in ext.name else None


def cythonized(exts):
    """exts with their .pyx sources turned into C by Cython (where the C file is
    missing or older than its sources): the same objects (build_ext keeps its own
    attributes on them), their sources the C files."""
    checks = env_flag("FASTATTN_DEBUG_CHECKS")
    directives = {
        "language_level": 3,
        "boundscheck": checks,
        "wraparound": checks,
        "initializedcheck": checks,
        "cdivision": True,
        "embedsignature": True,
    }
    # Cython's own dependency scan misses `from fastattn cimport _tiles` (a module
    # cimported from a package) and the C headers: a generated file older than any
    # of them is stale, so regenerate it
    newest = max(os.path.getmtime(d) for ext in exts for d in ext.depends)
    for ext in exts:
        generated = os.path.splitext(ext.sources[0])[0] + ".c"
        if os.path.exists(generated) and os.path.getmtime(generated) < newest:
            os.remove(generated)
    converted = {ext.name: ext for ext in cythonize(exts, compiler_directives=directives,
                                                   nthreads=cythonize_jobs())}
    for ext in exts:
        ext.sources = converted[ext.name].sources
    return exts


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt})
