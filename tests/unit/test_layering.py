"""The layout's guarantees: no import cycle among ``sarathi_pp``'s modules (imports inside
functions count; ``if TYPE_CHECKING:`` ones do not) and the import contracts of
``pyproject.toml`` (``lint-imports``) kept."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:  # recursion depth <= number of modules (~100)
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in graph.find_modules_directly_imported_by(module):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                m = stack.pop()
                on_stack.discard(m)
                component.append(m)
                if m == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return sorted(cycles)


def describe(graph: grimp.ImportGraph, cycle: list[str]) -> str:
    """One cycle as the imports that close it (module -> module, line)."""
    members = set(cycle)
    lines = []
    for importer in cycle:
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & members):
            for d in graph.get_import_details(importer=importer, imported=imported):
                lines.append(f"  {importer} -> {imported} (l.{d['line_number']})")
    return "\n".join(lines)


def test_no_import_cycles():
    graph = grimp.build_graph("sarathi_pp", exclude_type_checking_imports=True)
    assert len(graph.modules) > 50  # the whole package was read
    cycles = import_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n\n".join(describe(graph, c) for c in cycles)


def test_cycle_finder_finds_a_cycle():
    graph = grimp.ImportGraph()
    for a, b in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d")):
        graph.add_import(importer=a, imported=b)
    assert import_cycles(graph) == [["p.a", "p.b", "p.c"]]


def test_import_contracts_are_kept():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    proc = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def values_tier() -> list[str]:
    """The modules of the contract's bottom tier (``a : b : ...``), from pyproject.toml."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    layers = config["tool"]["importlinter"]["contracts"][0]["layers"]
    return [name.strip() for name in layers[-1].split(":")]


def test_the_values_tier_imports_only_the_standard_library_and_values():
    """No I/O library, no torch, nothing of the tiers above: every import of a value module
    (inside functions too) is of the standard library or another value module."""
    values = values_tier()
    assert {"config", "microbatch", "sampling_params", "outputs"} <= set(values)
    graph = grimp.build_graph("sarathi_pp", include_external_packages=True)
    stdlib = set(sys.stdlib_module_names)
    offenders = []
    for name in values:
        module = f"sarathi_pp.{name}"
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            top = imported.split(".")[0]
            inner = imported.split(".")[1] if imported.startswith("sarathi_pp.") else None
            if top in stdlib or (inner is not None and inner in values):
                continue
            offenders.append(f"{module} -> {imported}")
    assert offenders == []


def test_every_module_of_the_package_is_in_a_tier():
    """A new top-level module or package of sarathi_pp gets a place in the tiers contract
    (a module outside every layer is constrained by none of them)."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    layers = config["tool"]["importlinter"]["contracts"][0]["layers"]
    tiered = {name.strip() for layer in layers for name in layer.replace("|", ":").split(":")}
    package = ROOT / "sarathi_pp"
    top = {p.stem for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")}
    top |= {p.name for p in package.iterdir() if (p / "__init__.py").is_file()}
    assert sorted(top - tiered) == []
