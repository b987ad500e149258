"""The CPU kernels as C files: each builds from a clean cache, the cache is keyed by what the
build reads (the source and its headers), no Python module holds C source, and a wheel of
the project ships the sources."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from sarathi_pp.stages.kernels.cpu import build as kernel_build

ROOT = Path(__file__).resolve().parents[2]
KERNELS = sorted(kernel_build.KERNEL_DIR.glob("*.c"))


def test_the_kernel_folder_holds_the_four_kernels():
    names = {p.stem for p in KERNELS}
    assert names == {"paged_attention", "panel_gemm", "fused", "layer_loop"}, names


@pytest.mark.parametrize("source", KERNELS, ids=lambda p: p.stem)
def test_each_kernel_builds_from_a_clean_cache(source, tmp_path, monkeypatch):
    """Compiled straight from the shipped file (its headers found beside it) into an empty
    cache dir, then loaded; a second build reuses the library instead of compiling."""
    if source.stem == "panel_gemm" and not {"avx2", "fma"} <= kernel_build.cpu_flags():
        pytest.skip("panel_gemm.c needs AVX2 + FMA (it #errors without them)")
    monkeypatch.setenv("SARATHI_PP_KERNEL_DIR", str(tmp_path))
    lib, threads = kernel_build.build(f"test-{source.stem}", source)
    assert threads in (kernel_build.OPENMP, "pthreads")
    built = sorted(tmp_path.glob(f"test-{source.stem}-*.so"))
    assert len(built) == 1, built
    mtime = built[0].stat().st_mtime_ns
    kernel_build.build(f"test-{source.stem}", source)
    assert sorted(tmp_path.glob("*.so")) == built and built[0].stat().st_mtime_ns == mtime


def test_the_cache_key_covers_the_headers(tmp_path):
    """A change to a header the kernel includes is a new library, not a stale one."""
    (tmp_path / "k.c").write_text('#include "h.h"\nint f(void) { return H; }\n')
    (tmp_path / "h.h").write_text("#define H 1\n")
    before = kernel_build.source_key(tmp_path / "k.c")
    (tmp_path / "h.h").write_text("#define H 2\n")
    assert kernel_build.source_key(tmp_path / "k.c") != before


def test_a_compile_error_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SARATHI_PP_KERNEL_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "bad.c"
    bad.write_text("int f(void) { return }\n")
    with pytest.raises(kernel_build.KernelUnavailable, match="bad.c"):
        kernel_build.build("bad", bad)


def _holds_c(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and "#include" in node.value
        and "{" in node.value
    )


def test_no_python_module_holds_c_source():
    offenders = []
    for path in (ROOT / "sarathi_pp").rglob("*.py"):
        tree = ast.parse(path.read_text())
        if any(_holds_c(node) for node in ast.walk(tree)):
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_no_stage_module_is_over_450_lines():
    lines = {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines())
        for p in (ROOT / "sarathi_pp" / "stages").rglob("*.py")
    }
    assert {path: n for path, n in lines.items() if n > 450} == {}


@pytest.mark.slow
def test_the_wheel_ships_the_kernel_sources(tmp_path):
    """``pip wheel .`` (no build isolation: the venv's setuptools; nothing downloaded)."""
    env = {**os.environ, "PIP_NO_INDEX": "1"}
    cmd = [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
           "-w", str(tmp_path), "-q"]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=tmp_path, env=env, timeout=300)
    (wheel,) = tmp_path.glob("sarathi_pp-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for source in [*KERNELS, *kernel_build.KERNEL_DIR.glob("*.h")]:
        assert f"sarathi_pp/stages/kernels/cpu/{source.name}" in names, source.name
