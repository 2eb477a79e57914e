"""PyTorch binding: the only public part of mmapcache that imports torch.

:class:`CachedDataset` wraps a map-style dataset and keeps its samples in one
:class:`~mmapcache.Cache` file that every process on the node opens by path:
DataLoader workers, DDP ranks, other jobs, the next run.

How a sample maps to the file
-----------------------------
A sample is a leaf (tensor, ndarray, numpy scalar, Python bool/int/float) or a
tuple, list or dict of leaves, nested one level. Each leaf is one cache field,
named by its place in the sample, so that a process that opens a warm cache
rebuilds the structure from the field names alone, without asking the dataset:

=====================  ==============  ======================================
sample                 field names     note
=====================  ==============  ======================================
``x``                  ``.``           a bare leaf
``(x, y)``             ``0``, ``1``    tuple positions are digits
``[x, y]``             ``[0]``, ``[1]``
``{"image": x}``       ``image``       keys ``[A-Za-z_][A-Za-z0-9_.-]*`` as is,
``{"a b": x}``         ``"a b"``       other keys JSON-quoted
``(x, {"m": y})``      ``0``, ``1/m``  one level of nesting, joined by ``/``
=====================  ==============  ======================================

The same names declare the schema with ``fields=`` when samples vary in
shape: ``(tokens, label)`` with ``fields={"0": Field((None,), "int64"),
"1": Field((), "int64")}``. A variable leaf comes back as a tensor of its own
shape; ``ds.loader(ragged=...)`` batches them as a :class:`Padded` tensor plus
lengths, a nested tensor, a :class:`Packed` ``(values, cu_seqlens,
max_seqlen)`` or a list, from one gather per batch; for a DataLoader of your
own, :func:`collate` is ``default_collate`` without a second copy of a warm
batch, and :func:`pad_collate` pads samples.

Where things live
-----------------
``_dataset.py`` (CachedDataset: arguments, pickling, public verbs) ·
``_settings.py`` (the checked arguments) · ``_session.py`` (one process's
handle, counters, read and miss paths) · ``_schema.py`` (fields inferred,
declared, described) · ``_checks.py`` (right file, stale content,
determinism, in-place transforms) · ``_leaves.py`` (what a leaf is, and the one
rule for whether it fits a field) · ``_columns.py`` (batches as per-field
columns) · ``_loader.py`` (``loader()``) · ``_ragged.py`` (``ragged=``: variable
fields in a batch, ``Packed``) · ``_collate.py`` (``pad_collate``,
``Padded``) · ``_fill.py`` (``fill()``) · ``_packed.py`` (:class:`PackedSequences`: packed
sequences over cached documents; its plans in ``_packing_plan.py`` and their file in
``_plan_file.py``) · ``_stream.py`` (:class:`CachedStream`, over the
core's ``mmapcache._streams.stream_cache``) · ``_mixture.py`` (:class:`Mixture`, whose draws
are ``_draws.py``'s and whose ``loader()`` is ``_mixture_loader.py``). :class:`NodeShardSampler` is
:mod:`mmapcache.torch._sampler`'s.
"""

from __future__ import annotations

from ._collate import Padded, collate, pad_collate
from ._dataset import CachedDataset
from ._mixture import Mixture
from ._packed import PackedSequences
from ._ragged import Packed, ragged_collate
from ._sampler import NodeShardSampler
from ._schema import infer_fields
from ._stream import CachedStream

__all__ = [
    "CachedDataset",
    "CachedStream",
    "Mixture",
    "NodeShardSampler",
    "Packed",
    "PackedSequences",
    "Padded",
    "collate",
    "pad_collate",
    "ragged_collate",
]

# Pickles name the public module, whatever file the class lives in.
CachedDataset.__module__ = __name__
CachedStream.__module__ = __name__
Mixture.__module__ = __name__
Padded.__module__ = __name__
Packed.__module__ = __name__
PackedSequences.__module__ = __name__
NodeShardSampler.__module__ = __name__
_ = infer_fields  # mmapcache.torch.infer_fields, as in 0.3.0
