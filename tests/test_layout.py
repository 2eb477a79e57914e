"""The package's layout: layers import downwards only, folders through their named surface, no cycles.

docs/layout.md draws the same map; these tests keep it true.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mmapcache"
LAYOUT_DOC = ROOT / "docs" / "layout.md"

# Lowest first: a module may import from its own unit and from units of a lower layer, never a higher one.
LAYERS: dict[str, int] = {
    "_errors": 0,
    "_field": 0,
    "_version": 0,
    "_compare": 0,
    "_moved": 0,  # imports nothing; names the modules of today as strings, imported when a pickle asks
    "_format": 1,
    "_file": 2,
    "_region": 3,
    "cache": 4,
    "_streams": 5,
    "_admin": 6,
    "testing": 7,
    "torch": 8,
    "cli": 9,
    "__main__": 9,
}
FOLDERS = ("_format", "_file", "_region", "_streams", "_admin")
# The package's public face re-exports every layer.
EXEMPT = {"mmapcache"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def unit(module: str) -> str:
    """The layer unit of a module: its folder (``_region``), or itself at the root (``cache``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def imported(path: Path, *, top_level_only: bool = False) -> Iterator[tuple[int, str]]:
    """``(line, module)`` for every import of a mmapcache module in ``path`` (names resolved to modules)."""
    module = module_name(path)
    tree = ast.parse(path.read_text())
    nodes: list[ast.AST] = list(tree.body) if top_level_only else list(ast.walk(tree))
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "mmapcache":
                continue
            for alias in node.names:
                candidate = target + "." + alias.name
                yield node.lineno, candidate if _is_module(candidate) else target
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "mmapcache":
                    yield node.lineno, alias.name


def _is_module(dotted: str) -> bool:
    relative = Path(*dotted.split(".")[1:]) if "." in dotted else Path()
    return (PACKAGE / relative).with_suffix(".py").exists() or (PACKAGE / relative / "__init__.py").exists()


def test_every_unit_has_a_layer() -> None:
    units = {unit(module_name(path)) for path in modules() if module_name(path) not in EXEMPT}
    assert units <= set(LAYERS), f"give these a layer in LAYERS and docs/layout.md: {sorted(units - set(LAYERS))}"


def test_imports_point_down_the_layers() -> None:
    wrong = []
    for path in modules():
        module = module_name(path)
        if module in EXEMPT:
            continue
        here = unit(module)
        for line, target in imported(path):
            there = unit(target)
            if target == "mmapcache":
                wrong.append(f"{module}:{line} imports the package root (import from the module that defines it)")
            elif there != here and LAYERS[there] > LAYERS[here]:
                wrong.append(f"{module}:{line} ({here}, layer {LAYERS[here]}) imports {target} (layer {LAYERS[there]})")
    assert not wrong, "\n".join(wrong)


def test_other_units_import_a_folder_through_its_surface() -> None:
    # Each folder's __init__ names what the rest of the package may use of it.
    wrong = []
    for path in modules():
        module = module_name(path)
        here = unit(module)
        for line, target in imported(path):
            there = unit(target)
            if there in FOLDERS and there != here and target != f"mmapcache.{there}" and "_cgather" not in target:
                wrong.append(f"{module}:{line} imports {target}: import it from mmapcache.{there}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles_between_modules() -> None:
    graph = {
        module_name(path): {t for _, t in imported(path, top_level_only=True) if t != module_name(path)}
        for path in modules()
    }
    # A package's __init__ importing its own submodules is how a surface is made, not a cycle.
    for module, targets in graph.items():
        graph[module] = {t for t in targets if not t.startswith(module + ".")}
    cycles = _cycles(graph)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_root_stays_small() -> None:
    files = sorted(p.name for p in PACKAGE.iterdir() if p.is_file())
    assert len(files) <= 16, files


def test_every_folder_says_what_it_holds_and_who_uses_it() -> None:
    for folder in (*FOLDERS, "testing", "torch"):
        doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text()))
        assert doc, f"mmapcache/{folder}/__init__.py has no docstring"
        if folder in FOLDERS:
            assert "Used by" in doc, f"mmapcache/{folder}/__init__.py does not say who uses it"


def test_no_two_modules_share_a_name() -> None:
    seen: dict[str, Path] = {}
    twins = []
    for path in modules():
        if path.name == "__init__.py":
            continue
        stem = path.stem.lstrip("_")
        if stem in seen:
            twins.append(f"{seen[stem].relative_to(ROOT)} and {path.relative_to(ROOT)}")
        seen[stem] = path
    assert not twins, twins


def test_no_surface_name_hides_a_module_of_its_folder() -> None:
    # ``from .gc import gc`` in an __init__ would make mmapcache._admin.gc the function, not the module.
    for folder in FOLDERS:
        init = PACKAGE / folder / "__init__.py"
        tree = ast.parse(init.read_text())
        exported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        hidden = sorted(name for name in exported if (PACKAGE / folder / f"{name}.py").exists())
        assert not hidden, f"{folder}: {hidden}"


def sections() -> dict[str, str]:
    """docs/layout.md's sections by the folder their heading names (``mmapcache/_region/`` -> ``_region``)."""
    found: dict[str, str] = {}
    for part in LAYOUT_DOC.read_text().split("\n## ")[1:]:
        heading, _, body = part.partition("\n")
        match = re.search(r"`mmapcache/(\w*)/?`", heading)
        if match:
            found[match.group(1)] = body
    return found


def named_in(body: str) -> set[str]:
    names = set()
    for cell in re.findall(r"^\| ([^|]+) \|", body, re.M):
        names |= set(re.findall(r"`([\w./]+)`", cell))
    return names


@pytest.mark.parametrize("path", [p for p in modules()], ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_layout_doc_names_every_module(path: Path) -> None:
    relative = path.relative_to(PACKAGE)
    folder = "" if relative.parent == Path(".") else relative.parts[0]
    body = sections().get(folder)
    assert body is not None, f"docs/layout.md has no section for mmapcache/{folder}/"
    name = f"{folder}/" if path.name == "__init__.py" and folder else relative.name
    assert name in named_in(body), f"docs/layout.md's section of mmapcache/{folder}/ does not name {name}"


def test_the_layout_doc_names_no_module_that_is_gone() -> None:
    gone = []
    for folder, body in sections().items():
        for name in named_in(body):
            if name.endswith("/"):
                continue
            if not (PACKAGE / folder / name).exists():
                gone.append(f"{folder}/{name}")
    assert not gone, gone
