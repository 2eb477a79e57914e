"""``ds.loader(stateful=True)``: the loader as torchdata's ``StatefulDataLoader``, resumable mid-epoch.

torchdata is an optional dependency: this module is imported only when asked
for. The class is :class:`~._loader.Loader` (batches of hits gathered with one
copy, worker batches gathered in the main process) on top of
``StatefulDataLoader``, whose ``state_dict()`` records where the loader is —
the sampler's state (``NodeShardSampler``'s and torchdata's own samplers' are
exact), the batches handed out — and whose ``load_state_dict()`` makes the next
iterator yield exactly the batches that were left (the same samples in the same
batches; a random ``transform`` draws afresh, from generators restarted from their seed).
"""

from __future__ import annotations

from typing import Any

from ._loader import Loader

try:
    from torchdata.stateful_dataloader import StatefulDataLoader  # type: ignore[import-untyped]  # no py.typed
except ImportError as error:  # pragma: no cover - exercised in a process without torchdata
    raise ImportError(
        "ds.loader(stateful=True) returns torchdata's StatefulDataLoader, and torchdata is not installed: "
        "pip install torchdata (or pass stateful=False)"
    ) from error

__all__ = ["StatefulLoader"]


class StatefulLoader(Loader, StatefulDataLoader):  # type: ignore[misc]  # torchdata ships no type hints
    """What ``ds.loader(stateful=True)`` returns: a :class:`~._loader.Loader` that is a ``StatefulDataLoader``.

    ``state_dict()`` / ``load_state_dict()`` are torchdata's: save the state
    after a batch, and a loader made the same way that loads it yields the rest
    of the epoch, batch for batch.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
