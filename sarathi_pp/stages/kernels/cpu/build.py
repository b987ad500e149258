"""Build and load the stages' small C kernels for CPU: ``paged_attention.c`` (attention over
the paged cache), ``panel_gemm.c`` (matmuls with a prepacked weight), ``fused.c`` (norms,
rotary, SiLU) and ``layer_loop.c`` (a stage's layers in one call), each with its Python
wrapper beside it in this folder.

Each kernel is one C file shipped as package data (with ``exp_f.h``, the headers it may
include), compiled on first use with the system C compiler (``cc``; ~0.5 s, ``-O3
-march=native``) into the user's cache (``~/.cache/sarathi_pp/kernels``, or
``$SARATHI_PP_KERNEL_DIR``; keyed by the source and headers, flags and CPU) and loaded with
ctypes: no torch headers, no build step at install time.

Note [the kernels' threads]: torch's CPU ops run on an OpenMP pool (libgomp in Linux wheels)
whose threads spin for a while after each op. Threads of our own (pthreads) then compete with
them for the cores: inside a decode step on 2 cores (``benchmarks/piggyback.py``) the attention
kernel on pthreads of its own was far slower than with ``OMP_WAIT_POLICY=PASSIVE``. So where
torch's runtime is libgomp a kernel is built with ``-fopenmp``: its ``libgomp.so.1`` is the one
torch loaded (the same soname), and its parallel regions run on torch's own threads, faster
still (the figures: the lab notebook's "Figures moved out of the code",
Note [the kernels' threads]). Where that does not hold (another OpenMP runtime, no ``/proc``, a
compiler without OpenMP) a kernel has a build without OpenMP or is not used.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).resolve().parent  # the .c files and the headers they include

# -fno-trapping-math: without it GCC keeps a float compare-and-select (exp's clamp) as a branch,
# and the loops around it scalar: the attention kernel's softmax exp and SiLU's exp vectorise
# only with it (one layer of 32 x 1k decode attention 5-7% faster; SiLU * up 4x). No kernel
# here relies on floating-point traps.
FLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp-simd",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-shared",
    "-fPIC",
]
OPENMP_FLAGS = ["-fopenmp"]

OPENMP = "openmp (torch's libgomp threads)"


class KernelUnavailable(OSError):
    """A kernel could not be built or loaded; the message says why."""


def kernel_dir() -> Path:
    env = os.environ.get("SARATHI_PP_KERNEL_DIR")
    return Path(env) if env else Path.home() / ".cache" / "sarathi_pp" / "kernels"


def cpu_signature() -> str:
    """What ``-march=native`` compiled for: a library is keyed by it, so a home directory
    shared by machines with different CPUs never loads another CPU's build."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return platform.machine() + "".join(sorted(set(lines)))
    except OSError:
        return platform.machine() + platform.processor()


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``avx2``, ``fma``, ``avx512f``, ...; empty where
    ``/proc/cpuinfo`` is missing)."""
    try:
        with open("/proc/cpuinfo") as f:
            return {flag for ln in f if ln.startswith("flags") for flag in ln.split(":")[1].split()}
    except OSError:
        return set()


def loaded_libgomp() -> list[str]:
    """The GNU OpenMP runtimes mapped into this process (torch's, once torch is imported,
    where torch's parallel backend is libgomp: Linux wheels bundle it as libgomp.so.1)."""
    try:
        with open("/proc/self/maps") as f:
            return sorted({ln.split()[-1] for ln in f if "/libgomp" in ln})
    except OSError:  # not Linux
        return []


def _compile(path: Path, source: Path, flags: list[str]) -> None:
    """Build the library at ``path`` from ``source`` (atomically: stage actors may build it
    at once); the headers ``source`` includes are found beside it."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise KernelUnavailable("no C compiler (cc, gcc) on PATH")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        lib = Path(tmp) / path.name
        cmd = [compiler, *flags, f"-I{source.parent}", str(source), "-o", str(lib), "-pthread"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            raise KernelUnavailable(f"{' '.join(cmd)} failed: {e}") from e
        if proc.returncode != 0:
            raise KernelUnavailable(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-500:]}")
        os.replace(lib, path)


def source_key(source: Path) -> str:
    """What a build of ``source`` depends on besides flags and CPU: its text and the text of
    every header beside it (a kernel includes only those)."""
    try:
        texts = [source.read_text()]
        texts += [h.read_text() for h in sorted(source.parent.glob("*.h"))]
    except OSError as e:
        raise KernelUnavailable(f"reading the kernel source {source}: {e}") from e
    return "".join(texts)


def _build_and_load(name: str, source: Path, flags: list[str]) -> ctypes.CDLL:
    key = hashlib.sha256((source_key(source) + " ".join(flags) + cpu_signature()).encode())
    path = kernel_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    if not path.exists():
        _compile(path, source, flags)
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelUnavailable(f"loading {path}: {e}") from e


def build(
    name: str, source: Path, *, need_openmp: bool = False, extra_flags: tuple[str, ...] = ()
) -> tuple[ctypes.CDLL, str]:
    """``source`` (a ``.c`` file of this folder) compiled and loaded, and how it runs its
    threads: ``OPENMP`` (built with ``-fopenmp`` on torch's libgomp, see Note [the kernels'
    threads]) or ``"pthreads"`` (built without OpenMP: the source's ``#ifndef _OPENMP`` path). With ``need_openmp`` there is no
    build without OpenMP: ``KernelUnavailable`` instead. ``extra_flags`` follow ``FLAGS``
    (e.g. ``-mno-avx512f``: a source's AVX2 path on an AVX-512 CPU). Raises
    ``KernelUnavailable`` with the reason when nothing builds."""
    flags = FLAGS + list(extra_flags)
    runtimes = loaded_libgomp()
    why = f"torch's OpenMP runtime is not one libgomp ({runtimes or 'none mapped'})"
    if len(runtimes) == 1:
        try:
            lib = _build_and_load(name, source, flags + OPENMP_FLAGS)
            if loaded_libgomp() == runtimes:
                return lib, OPENMP
            why = f"its OpenMP build loaded {loaded_libgomp()} beside torch's {runtimes}"
            log.warning("%s kernel: %s", name, why)
        except KernelUnavailable as e:
            why = str(e)
    if need_openmp:
        raise KernelUnavailable(f"needs torch's OpenMP threads: {why}")
    log.info("%s kernel without OpenMP (%s): its own threads", name, why)
    return _build_and_load(name, source, flags), "pthreads"


def build_unless_off(
    name: str, source: Path, switch: str, what: str, instead: str
) -> tuple[ctypes.CDLL | None, str]:
    """``build(name, source)`` for a kernel the model can do without: ``(library, how its
    threads run)``, or ``(None, why not)`` when the environment variable ``switch`` is ``0``
    or nothing builds (logged once as a warning: "<what> unavailable, <instead>: <reason>")."""
    if os.environ.get(switch, "1") == "0":
        return None, f"disabled by {switch}=0"
    try:
        return build(name, source)
    except KernelUnavailable as e:
        log.warning("%s unavailable, %s: %s", what, instead, e)
        return None, f"unavailable: {e}"
