"""How far one batch of ``CachedDataset.__getitems__`` travels through mmapcache's modules.

Traces (``sys.setprofile``) one *warm* batch (every sample cached) and one
*miss* batch (none cached; the process already loaded a batch before, so the
once-per-process checks are not part of it), each through ``__getitems__``
and through ``ds.loader()`` (in process), and counts, over the frames of
functions defined in the ``mmapcache`` package only (numpy, torch and the
standard library are looked through):

* **functions** and **modules** crossed: distinct functions entered, and the
  modules that define them;
* **climbs**: calls that go back up, against the modules' imports: a frame of
  module ``A`` calls a function of module ``B`` although ``B`` is not below
  ``A`` (``A`` imports it neither directly nor through the modules it imports)
  — a callback handed down, or a lower layer reaching into a higher one. A
  layered design calls only into what lies below it. Counted once per call
  site (caller function, callee function), however often the batch repeats it;
  ``calls`` counts every such call;
* **re-entries**: calls into a module that is already on the stack below a
  frame of another module (``A -> B -> A``); **re-entry sites** count each
  chain of modules once, however often a loop repeats it.

The ``miss 32`` trace is the target a miss batch is held to (a 32-sample batch
through ``__getitems__``: its functions and re-entry sites; see
tests/torch/test_call_paths.py).

Run it in a checkout (``PYTHONPATH=$PWD python benchmarks/call_paths.py``), or
against another source tree of mmapcache with ``--source DIR`` (e.g. a
``git worktree`` of an older commit), to compare before and after. ``--show``
lists each climb as the chain of modules on the stack.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

BATCH = 16
MISS_BATCH = 32  # the batch the miss path's targets are stated for
LENGTH = 128


class Samples:
    """A deterministic map-style dataset: an image-like uint8 tensor and an int label."""

    def __len__(self) -> int:
        return LENGTH

    def __getitem__(self, i: int) -> Any:
        import torch

        return torch.full((3, 8, 8), i % 251, dtype=torch.uint8), i


def imports(package: Path) -> dict[str, set[str]]:
    """The mmapcache modules below each module of ``package``: imported by it, directly or not (lazy imports count)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        here = name.split(".") if parts[-1] == "__init__" else name.split(".")[:-1]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                module = ".".join([*base, *(node.module.split(".") if node.module else [])])
                found.add(module)
                found.update(f"{module}.{alias.name}" for alias in node.names)  # `from . import x`
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = {module for module in found if module.split(".")[0] == "mmapcache"}
    below: dict[str, set[str]] = {}
    for name in graph:  # what each module imports, directly or through the modules it imports
        seen: set[str] = set()
        todo = list(graph[name])
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo.extend(graph.get(module, ()))
        below[name] = seen
    return below


class Tracer:
    """Counts functions, modules, climbs and re-entries of the mmapcache frames that one call makes."""

    def __init__(self, package: Path) -> None:
        self.package = str(package) + os.sep
        self.imports = imports(package)
        self.stack: list[tuple[str, str]] = []  # (module, function) of each mmapcache frame, innermost last
        self.depth: list[bool] = []  # for every traced frame: whether it is an mmapcache one
        self.functions: set[tuple[str, str]] = set()
        self.climbs: dict[tuple[str, str, str, str], int] = {}
        self.reentries: list[str] = []

    def module(self, frame: FrameType) -> str | None:
        filename = frame.f_code.co_filename
        if not filename.startswith(self.package):
            return None
        relative = filename[len(self.package) :].removesuffix(".py").replace(os.sep, ".")
        return "mmapcache." + relative.removesuffix(".__init__")

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            module = self.module(frame)
            self.depth.append(module is not None)
            if module is None:
                return
            function = frame.f_code.co_qualname
            self.functions.add((module, function))
            if self.stack and self.stack[-1][0] != module:
                caller, called = self.stack[-1]
                if module not in self.imports.get(caller, set()):
                    site = (caller, called, module, function)
                    self.climbs[site] = self.climbs.get(site, 0) + 1
                if any(module == m for m, _ in self.stack):
                    self.reentries.append(" > ".join(m for m, _ in [*self.stack, (module, function)]))
            self.stack.append((module, function))
        elif event == "return" and self.depth and self.depth.pop():
            self.stack.pop()

    def trace(self, call: Callable[[], object]) -> dict[str, Any]:
        result = None
        sys.setprofile(self)
        try:
            result = call()  # kept until the trace ends: dropping the batch is not part of the call
        finally:
            sys.setprofile(None)
        del result
        modules = sorted({module for module, _ in self.functions})
        return {
            "functions": len(self.functions),
            "modules": len(modules),
            "climbs": len(self.climbs),
            "climb_calls": sum(self.climbs.values()),
            "reentries": len(self.reentries),
            "reentry_sites": len(set(self.reentries)),  # loops counted once
            "module_names": modules,
            "function_names": sorted(f"{m}:{f}" for m, f in self.functions),
            "climb_sites": [f"{a}:{f} -> {b}:{g} (x{n})" for (a, f, b, g), n in sorted(self.climbs.items())],
            "reentry_chains": self.reentries,
        }


def measure(directory: Path) -> dict[str, dict[str, Any]]:
    import mmapcache
    from mmapcache.torch import CachedDataset

    package = Path(mmapcache.__file__).resolve().parent
    ds = CachedDataset(Samples(), directory / "paths.mmc", key="call-paths")
    ds.__getitems__(list(range(BATCH)))  # creates the file; this process's first miss (its checks run once)
    ds.__getitems__(list(range(BATCH)))  # warm: the first hit batch of the process
    warm = list(range(BATCH - 1, -1, -1))
    miss = list(range(2 * BATCH, 3 * BATCH))
    loader = ds.loader(
        batch_size=BATCH, sampler=list(range(BATCH)) * 2
    )  # in this process: Batched.__getitems__ makes each batch
    batches = iter(loader)
    next(batches)  # warm (the first batch of the process's iterator is not traced)
    loader_miss = ds.loader(batch_size=BATCH, sampler=list(range(3 * BATCH, 4 * BATCH)))
    miss_32 = list(range(4 * BATCH, 4 * BATCH + MISS_BATCH))
    out = {
        "warm": Tracer(package).trace(lambda: ds.__getitems__(warm)),
        "miss": Tracer(package).trace(lambda: ds.__getitems__(miss)),
        "loader() warm": Tracer(package).trace(lambda: next(batches)),
        "loader() miss": Tracer(package).trace(lambda: next(iter(loader_miss))),
        "miss 32": Tracer(package).trace(lambda: ds.__getitems__(miss_32)),
    }
    ds.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, help="a source tree of mmapcache to trace (default: the one imported)")
    parser.add_argument("--show", action="store_true", help="list each climb as its chain of modules")
    parser.add_argument("--json", action="store_true", help="print the counts as JSON")
    args = parser.parse_args()
    if args.source is not None:
        sys.path.insert(0, str(args.source.resolve()))
    with tempfile.TemporaryDirectory() as directory:
        result = measure(Path(directory))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for name, counts in result.items():
        print(
            f"{name} batch: {counts['functions']} functions in {counts['modules']} modules; "
            f"{counts['climbs']} climbs back up ({counts['climb_calls']} calls), {counts['reentries']} re-entries "
            f"({counts['reentry_sites']} sites)"
        )
        if args.show:
            print("  modules: " + ", ".join(counts["module_names"]))
            for site in counts["climb_sites"]:
                print("  climb: " + site)
            for chain in counts["reentry_chains"]:
                print("  re-entry: " + chain)


if __name__ == "__main__":
    main()
