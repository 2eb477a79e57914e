"""Variable-shape fields in a batch: ``loader(ragged=)`` and :func:`collate` make one of four batch types.

A batch of a variable field is gathered from the file once, into one
:class:`~mmapcache.Jagged` (every row's values in one array, and offsets); how
it then appears in the batch is the ``ragged`` choice:

* ``"pad"``: a :class:`~._collate.Padded` ``(data, lengths)``, as
  :func:`~._collate.pad_collate` makes it — each row copied into its row of the
  padded buffer by one compiled call (:meth:`~mmapcache.Jagged.to_padded`);
* ``"nested"``: a jagged-layout nested tensor that views the values (no copy);
* ``"packed"``: a :class:`Packed` ``(values, cu_seqlens, max_seqlen)``, what
  varlen attention kernels take — the values themselves (no copy);
* ``"list"``: a list of one tensor per sample, each its own shape (views of
  the values), as a collate that keeps lists gives.

Text fields are lists of ``str``/``bytes`` whatever the choice (as
``default_collate`` makes them).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from .._region import Jagged, nested
from ._collate import Padded, Padder, leaf_names, pad_tensors

__all__ = ["RAGGED", "Packed", "check_ragged", "jagged_batch", "ragged_collate", "tensors_batch"]

RAGGED = ("pad", "nested", "packed", "list")


class Packed(NamedTuple):
    """A batch of sequences packed end to end: what ``ragged="packed"`` makes of a variable field.

    ``values`` has shape ``(total, *tail)``: every sample's rows, one after
    the other; sample ``k`` is ``values[cu_seqlens[k]:cu_seqlens[k + 1]]``.
    ``cu_seqlens`` (int32, ``batch + 1`` entries from 0) and ``max_seqlen``
    (a Python int, the longest sample) are the arguments varlen attention
    kernels (``flash_attn_varlen_func``) take, so nothing is read back from a
    device to find them.
    """

    values: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int


def check_ragged(ragged: Any) -> str:
    """``ragged=`` checked: one of :data:`RAGGED`, else a ValueError naming them."""
    if not isinstance(ragged, str) or ragged not in RAGGED:
        choices = ", ".join(map(repr, RAGGED))
        raise ValueError(f"ragged must be one of {choices} (how a variable field appears in a batch), not {ragged!r}")
    return ragged


def jagged_batch(jagged: Jagged, ragged: str, dtype: torch.dtype | None, padding_value: float, name: str) -> Any:
    """A variable field's batch, as ``ragged`` asks, from its gathered :class:`~mmapcache.Jagged` (storage dtype).

    ``dtype`` is the field's torch dtype where it differs from the storage one (bfloat16 bits).
    """
    if ragged == "nested":
        _one_ragged_dimension(jagged, ragged, name)
        return jagged.to_nested(dtype)
    values = _tensor(jagged.values, dtype)
    if ragged == "packed":
        _one_ragged_dimension(jagged, ragged, name)
        return Packed(values, torch.from_numpy(np.array(jagged.cu_seqlens)), jagged.max_length)
    if ragged == "list":
        rows = list(torch.split(values, jagged.lengths.tolist()))  # views
        if jagged.shapes.shape[1] == 1 + len(jagged.tail):
            return rows
        return [row.reshape(shape) for row, shape in zip(rows, jagged.shapes.tolist(), strict=True)]
    try:
        data, lengths = jagged.to_padded(padding_value)  # one call copies every row into place
    except (OverflowError, ValueError, TypeError) as error:
        raise ValueError(
            f"field {name!r}: padding_value {padding_value!r} does not fit its {jagged.dtype} values ({error})"
        ) from None
    return Padded(_tensor(data, dtype), torch.from_numpy(np.array(lengths)))


def tensors_batch(column: Sequence[torch.Tensor], name: str, *, ragged: str, padding_value: float) -> Any:
    """A variable leaf's batch, as ``ragged`` asks, from one tensor per sample (a batch collated from samples)."""
    if ragged == "list":
        return list(column)
    if ragged == "pad":
        return pad_tensors(list(column), padding_value, name)
    tails = {tuple(t.shape[1:]) for t in column}
    if any(t.ndim == 0 for t in column) or len(tails) > 1:
        shapes = sorted({tuple(t.shape) for t in column}, key=len)[:4]
        raise ValueError(
            f"leaf {name!r} has samples of shapes {shapes}: ragged={ragged!r} batches vary in the first "
            "dimension only; use ragged='pad' or ragged='list' for it"
        )
    lengths = np.array([len(t) for t in column], np.int64)
    offsets = np.zeros(len(column) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = torch.cat(list(column))  # one copy of every sample into one buffer
    if ragged == "packed":
        cu_seqlens = torch.from_numpy(offsets.astype(np.int32))
        return Packed(values, cu_seqlens, int(lengths.max(initial=0)))
    return nested(values, offsets, (int(lengths.min(initial=0)), int(lengths.max(initial=0))))


def _one_ragged_dimension(jagged: Jagged, ragged: str, name: str) -> None:
    varying = jagged.shapes.shape[1] - len(jagged.tail)
    if varying != 1:
        raise ValueError(
            f"field {name!r} varies in {varying} dimensions, but ragged={ragged!r} batches vary in the first one "
            "only: use ragged='pad' or ragged='list' for it"
        )


def _tensor(array: np.ndarray[Any, Any], dtype: torch.dtype | None) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    return tensor if dtype is None or dtype == tensor.dtype else tensor.view(dtype)


class ragged_collate:  # noqa: N801 - used as a function: DataLoader(..., collate_fn=ragged_collate("packed"))
    """A ``collate_fn`` that batches variable leaves of samples as ``ds.loader(ragged=...)`` batches variable fields.

    For a plain ``DataLoader`` over per-sample data — a :class:`CachedStream`,
    or any dataset — where ``ds.loader()`` is not the loader:
    ``DataLoader(stream, batch_size=32, collate_fn=ragged_collate("packed"))``.
    ``ragged`` is one of ``"pad"``, ``"nested"``, ``"packed"``, ``"list"``
    (see :mod:`mmapcache.torch`); ``leaves`` names the leaves to batch that way
    by their field names (``"tokens"``, ``"0"``, ``"."``), every other leaf is
    collated by ``default_collate``; ``leaves=None`` takes every tensor leaf
    whose shapes differ *in this batch* (name them for a structure that never
    changes). Each call copies every sample's values once into the batch.
    Pickles (spawned DataLoader workers receive it).
    """

    def __init__(
        self, ragged: str = "pad", *, leaves: str | Collection[str] | None = None, padding_value: float = 0
    ) -> None:
        self.ragged = check_ragged(ragged)
        if isinstance(padding_value, bool) or not isinstance(padding_value, (int, float)):
            raise TypeError(f"padding_value must be a number, not {type(padding_value).__name__}")
        if leaves is not None and not isinstance(leaves, str):
            leaves = tuple(leaves)
        self.leaves, self.padding_value = leaves, padding_value

    def __call__(self, batch: Sequence[Any]) -> Any:
        if len(batch) == 0:
            raise ValueError("ragged_collate needs at least one sample")
        names = leaf_names(batch[0], self.leaves, "leaves")
        return Padder(names, self._leaf).collate(list(batch), [])

    def _leaf(self, column: list[torch.Tensor], name: str) -> Any:
        return tensors_batch(column, name, ragged=self.ragged, padding_value=self.padding_value)

    def __repr__(self) -> str:
        return f"ragged_collate({self.ragged!r}, leaves={self.leaves!r}, padding_value={self.padding_value!r})"
