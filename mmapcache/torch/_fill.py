"""``CachedDataset.fill()``: every missing cacheable slot loaded and stored, in this process or in workers."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
import torch.utils.data

from ._session import Session

__all__ = ["fill"]

log = logging.getLogger("mmapcache")


def fill(session: Session, *, num_workers: int, batch_size: int, progress: bool) -> int:
    """Fill every missing cacheable slot; return how many slots this call filled (see ``CachedDataset.fill``)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    before = session.written
    if session.settings.length == 0:
        return 0  # an empty shard: nothing to fill
    if session.opened() is None:
        # Create the file from a whole first chunk: samples whose shapes vary are found before it exists.
        first = list(range(min(batch_size, session.settings.length)))
        session.store(first, session.fetch(first))
    cache = session.handle()
    everything = np.arange(cache.capacity, dtype=np.intp)
    missing = everything[~cache.contains_many(everything)]
    chunks = [missing[start : start + batch_size] for start in range(0, len(missing), batch_size)]
    bar = _progress(len(missing), f"filling {session.settings.path.name}", enabled=progress)
    filled = session.written - before
    try:
        if num_workers > 0 and chunks:
            loader = torch.utils.data.DataLoader(
                _Chunks(session, chunks), batch_size=None, num_workers=num_workers, collate_fn=_identity
            )
            for done, wrote in loader:
                filled += wrote
                if bar is not None:
                    bar.update(done)
        else:
            for chunk in chunks:
                done, wrote = fill_chunk(session, chunk)
                filled += wrote
                if bar is not None:
                    bar.update(done)
    finally:
        if bar is not None:
            bar.close()
    if filled:
        session.handle().sync()  # on a disk: a reboot need not check what this fill wrote (see Cache.sync)
    return filled


def fill_chunk(session: Session, chunk: np.ndarray[Any, Any]) -> tuple[int, int]:
    """Load and store ``chunk``'s slots still missing; (slots handled, slots this call wrote)."""
    cache = session.handle()
    todo = chunk[~cache.contains_many(chunk)].tolist()
    before = session.written
    if todo:
        session.store(todo, session.fetch(todo))
    return len(chunk), session.written - before


class _Chunks(torch.utils.data.Dataset[tuple[int, int]]):
    """fill()'s work items for DataLoader workers: each loads and stores one chunk of positions."""

    def __init__(self, session: Session, chunks: list[np.ndarray[Any, Any]]) -> None:
        self.session, self.chunks = session, chunks

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, k: int) -> tuple[int, int]:
        return fill_chunk(self.session, self.chunks[k])


def _identity(value: Any) -> Any:
    return value


def _progress(total: int, description: str, *, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        log.info("%s: %d samples (install tqdm for a progress bar)", description, total)
        return None
    return tqdm(total=total, desc=description, unit="sample")
