"""The module name 0.3.0 pickled ``Padded`` batches under; it lives in :mod:`mmapcache.torch` now."""

from __future__ import annotations

from .torch import Padded

__all__ = ["Padded"]
