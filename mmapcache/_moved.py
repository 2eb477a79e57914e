"""The module names earlier releases pickled objects under, answered with the modules that hold them now.

A pickle names the module of every class it holds, and objects pickled by mmapcache 0.3 to 0.5
name modules that have moved since (``mmapcache._jagged`` is ``mmapcache._region.jagged`` now).
:func:`install` puts a finder on ``sys.meta_path`` that answers an import of such a name with the
module of today, so those pickles load. ``mmapcache/__init__.py`` installs it: an unpickler imports
``mmapcache`` first, the parent package of every name here. Public classes now pickle under
their public module (``mmapcache``, ``mmapcache.torch``), which does not move.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

__all__ = ["MOVED", "install"]

MOVED = {
    "mmapcache._batches": "mmapcache.torch",  # 0.3.0's Padded
    "mmapcache._collect": "mmapcache._admin.garbage",
    "mmapcache._counters": "mmapcache._region.counters",
    "mmapcache._disk_usage": "mmapcache._admin.df",
    "mmapcache._flight": "mmapcache._region.flight",
    "mmapcache._heap": "mmapcache._region.allocator",
    "mmapcache._inspect": "mmapcache._admin.listing",
    "mmapcache._jagged": "mmapcache._region.jagged",
    "mmapcache._resize": "mmapcache._admin.resizing",
    "mmapcache._sampler": "mmapcache.torch._sampler",
    "mmapcache._testing_machine": "mmapcache.testing._machine",
    "mmapcache._verify": "mmapcache._region.verify",
}
"""Each name 0.3 to 0.5 pickled a public class under that has moved, and the module it is in now."""


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of the names in :data:`MOVED`: the module of today, under both names."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module of today ran when it was imported."""


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once per process)."""
    if not any(isinstance(finder, _Moved) for finder in sys.meta_path):
        sys.meta_path.append(_Moved())
