"""The structure of a sample <-> the names of its cache fields (pure: no torch, no numpy).

A sample is a leaf or a tuple, list or dict of leaves, nested one level. What
counts as a leaf is the caller's business (``is_leaf``); this module only
names the places in the structure, reads them back and rebuilds samples.

Naming (existing cache files depend on it: never change it)
-----------------------------------------------------------
A leaf is named by its path from the root, components joined by ``/``:

=====================  ==============  ======================================
sample                 field names     component
=====================  ==============  ======================================
``x``                  ``.``           a bare leaf (no components)
``(x, y)``             ``0``, ``1``    a tuple position: its decimal digits
``[x, y]``             ``[0]``, ``[1]``  a list position, in brackets
``{"image": x}``       ``image``       a dict key matching
                                       ``[A-Za-z_][A-Za-z0-9_.-]*``, as is
``{"a b": x}``         ``"a b"``       any other key, JSON-quoted
``(x, {"m": y})``      ``0``, ``1/m``  one level of nesting
=====================  ==============  ======================================

The naming is a bijection: every name has one spelling (``00`` or ``[01]``
is not a name), and a set of names describes at most one structure. Dict keys
keep their order; tuple and list positions are ``0..n-1``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

__all__ = ["BARE", "Node", "Step", "Structure", "describe_where", "name_leaves", "name_of", "parse_name"]

BARE = "."
_SIMPLE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_POSITION = re.compile(r"0|[1-9][0-9]*")
_LIST_POSITION = re.compile(r"\[(0|[1-9][0-9]*)\]")
MAX_DEPTH = 2  # a container of leaves, or a container of containers of leaves

# One step from a container to its child: ("tuple", 0), ("list", 1) or ("dict", "key").
Step = tuple[str, Any]
# A node of a structure: an int is a leaf (the position of its field in the
# name list); a container is (kind, keys, children) with kind "tuple", "list" or "dict".
Node = int | tuple[str, tuple[Any, ...], tuple[Any, ...]]


def _component(kind: str, key: Any) -> str:
    if kind == "tuple":
        return str(key)
    if kind == "list":
        return f"[{key}]"
    return str(key) if _SIMPLE_KEY.fullmatch(key) else json.dumps(key)


def name_of(path: Sequence[Step]) -> str:
    """The field name of the leaf at ``path``: ``[("tuple", 1), ("dict", "m")]`` -> ``"1/m"``."""
    return "/".join(_component(kind, key) for kind, key in path) or BARE


def describe_where(path: Sequence[Step]) -> str:
    """``field '1/m'``, or ``the sample`` at the root: how error messages name a place."""
    return f"field {name_of(path)!r}" if path else "the sample"


def parse_name(name: str) -> list[Step]:
    """``"1/m"`` -> ``[("tuple", 1), ("dict", "m")]``; ValueError if ``name`` is not a name this module makes."""
    if name == BARE:
        return []
    parts: list[Step] = []
    pos = 0
    while True:
        if name.startswith('"', pos):
            try:
                key, end = json.JSONDecoder().raw_decode(name, pos)
            except json.JSONDecodeError:
                raise ValueError(f"{name!r}: a quoted key must be a JSON string") from None
            if not isinstance(key, str) or not key or name[pos:end] != json.dumps(key) or _SIMPLE_KEY.fullmatch(key):
                raise ValueError(f"{name!r}: {name[pos:end]} is not how a dict key is quoted")
            parts.append(("dict", key))
            pos = end
        else:
            end = name.find("/", pos)
            end = len(name) if end < 0 else end
            text = name[pos:end]
            if _POSITION.fullmatch(text):
                parts.append(("tuple", int(text)))
            elif _LIST_POSITION.fullmatch(text):
                parts.append(("list", int(text[1:-1])))
            elif _SIMPLE_KEY.fullmatch(text):
                parts.append(("dict", text))
            else:
                raise ValueError(f"{name!r}: {text!r} is neither a position nor a dict key")
            pos = end
        if pos == len(name):
            return parts
        if name[pos] != "/":
            raise ValueError(f"{name!r}: components must be separated by '/'")
        pos += 1


def tree_from_names(names: Sequence[str]) -> Node:
    """The structure a list of field names describes (the inverse of :func:`name_leaves`); else ValueError."""
    paths = [parse_name(name) for name in names]
    if not paths:
        raise ValueError("no names")
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate names in {list(names)}")
    if len(paths) == 1 and not paths[0]:
        return 0
    if any(not path for path in paths):
        raise ValueError(f"{BARE!r} (a bare leaf) cannot sit beside other names")
    if any(len(path) > MAX_DEPTH for path in paths):
        raise ValueError(f"containers nest at most {MAX_DEPTH - 1} level in {list(names)}")
    return _build_tree([(path, i) for i, path in enumerate(paths)])


def _build_tree(entries: list[tuple[list[Step], int]]) -> Node:
    kinds = {path[0][0] for path, _ in entries}
    if len(kinds) != 1:
        raise ValueError(f"one container cannot be a {' and a '.join(sorted(kinds))}")
    (kind,) = kinds
    groups: dict[Any, list[tuple[list[Step], int]]] = {}
    for path, position in entries:
        groups.setdefault(path[0][1], []).append((path[1:], position))
    keys = tuple(groups)
    if kind != "dict":
        if sorted(keys) != list(range(len(keys))):
            raise ValueError(f"{kind} positions {sorted(keys)} are not 0..{len(keys) - 1}")
        keys = tuple(sorted(keys))
    children: list[Node] = []
    for key in keys:
        group = groups[key]
        if len(group) == 1 and not group[0][0]:
            children.append(group[0][1])
        elif all(rest for rest, _ in group):
            children.append(_build_tree(group))
        else:
            raise ValueError(f"{_component(kind, key)!r} names both a leaf and a container")
    return (kind, keys, tuple(children))


def _container(value: Any, where: str) -> tuple[str, tuple[Any, ...], tuple[Any, ...]] | None:
    """``(kind, keys, values)`` if ``value`` is a supported container, None if it is not a container."""
    if type(value) is tuple:
        return ("tuple", tuple(range(len(value))), value)
    if type(value) is list:
        return ("list", tuple(range(len(value))), tuple(value))
    if isinstance(value, Mapping):
        bad = [k for k in value if not isinstance(k, str) or not k]
        if bad:
            raise TypeError(f"{where}: dict keys must be non-empty strings to be cached, got {bad[0]!r}")
        return ("dict", tuple(value), tuple(value.values()))
    if isinstance(value, tuple):  # a namedtuple or other tuple subclass
        raise TypeError(
            f"{where}: {type(value).__name__} (a tuple subclass) cannot be rebuilt from the cache; "
            "return a plain tuple or a dict from the dataset (or convert it in transform)"
        )
    return None


def _no_hint(value: Any) -> str:
    return ""


def name_leaves(
    sample: Any, is_leaf: Callable[[Any], bool], *, supported: str, hint: Callable[[Any], str] = _no_hint
) -> dict[str, Any]:
    """``{field name: leaf}`` for every leaf of ``sample``, in order (see the module docstring).

    TypeError/ValueError naming the first place that is neither a leaf nor a
    supported container; ``supported`` says what is, and ``hint(value)`` what
    to do instead (for the message).
    """
    leaves: dict[str, Any] = {}

    def visit(value: Any, path: list[Step]) -> None:
        if is_leaf(value):
            leaves[name_of(path)] = value
            return
        where = describe_where(path)
        container = _container(value, where)
        if container is None or len(path) >= MAX_DEPTH:
            what = "a container nested more than one level" if container else f"{type(value).__name__}"
            raise TypeError(f"{where}: {what} cannot be cached{hint(value)}; supported: {supported}")
        kind, keys, values = container
        if not keys:
            raise ValueError(f"{where}: an empty {kind} cannot be cached; supported: {supported}")
        for key, item in zip(keys, values, strict=True):
            visit(item, [*path, (kind, key)])

    visit(sample, [])
    return leaves


class Structure:
    """The structure that a list of field names describes, and how to go between samples and leaves.

    ``Structure(names)`` raises ValueError unless ``names`` is exactly what
    :func:`name_leaves` gives for some sample.
    """

    def __init__(self, names: Iterable[str]) -> None:
        self.names = tuple(names)
        self.tree = tree_from_names(self.names)
        self.build = _builder(self.tree)
        #: For a flat structure, a sample's parts in name order if it has this shape (leaves or not); else
        #: None. The fast path of :meth:`flatten`, for a caller that checks the leaves itself (a function,
        #: not a method: a batch calls it once per sample).
        self.candidates: Callable[[Any], list[Any] | None] = _flattener(self.tree)

    def flatten(
        self, sample: Any, is_leaf: Callable[[Any], bool], *, supported: str, hint: Callable[[Any], str] = _no_hint
    ) -> list[Any]:
        """``sample``'s leaves in name order; TypeError/ValueError naming the first part that does not fit."""
        leaves = self.candidates(sample)
        if leaves is not None and all(map(is_leaf, leaves)):
            return leaves
        return self._flatten_slowly(sample, is_leaf, supported, hint)

    def _flatten_slowly(
        self, sample: Any, is_leaf: Callable[[Any], bool], supported: str, hint: Callable[[Any], str]
    ) -> list[Any]:
        leaves: list[Any] = [None] * len(self.names)

        def visit(node: Node, value: Any, path: list[Step]) -> None:
            if isinstance(node, int):
                if not is_leaf(value):
                    what = type(value).__name__
                    raise TypeError(
                        f"field {name_of(path)!r}: {what} values cannot be cached{hint(value)}; supported: {supported}"
                    )
                leaves[node] = value
                return
            kind, keys, children = node
            where = describe_where(path)
            container = _container(value, where)
            if container is None or container[0] != kind or container[1] != keys:
                got = f"{container[0]} with keys {list(container[1])}" if container else f"a {type(value).__name__}"
                raise ValueError(
                    f"{where}: the cache holds a {kind} with keys {list(keys)} here, the dataset gave {got}"
                )
            for key, child, item in zip(keys, children, container[2], strict=True):
                visit(child, item, [*path, (kind, key)])

        visit(self.tree, sample, [])
        return leaves

    def __repr__(self) -> str:
        return f"Structure({list(self.names)!r})"


def _flattener(tree: Node) -> Callable[[Any], list[Any] | None]:
    """A fast path for the flat shapes: the candidate leaves in order, or None (then take the slow path)."""
    if isinstance(tree, int):
        return lambda sample: [sample]
    kind, keys, children = tree
    if list(children) != list(range(len(children))):
        return lambda sample: None
    if kind == "tuple":
        return lambda sample: list(sample) if type(sample) is tuple and len(sample) == len(keys) else None
    if kind == "list":
        return lambda sample: list(sample) if type(sample) is list and len(sample) == len(keys) else None
    return lambda sample: [sample[k] for k in keys] if type(sample) is dict and tuple(sample) == keys else None


def _builder(tree: Node) -> Callable[[Sequence[Sequence[Any]]], list[Any]]:
    """A function from per-field columns of per-sample leaves to a list of samples.

    The flat shapes (a bare leaf, a tuple, list or dict of leaves) take one
    C-level ``zip`` per batch; nested ones build each sample in Python.
    """
    if isinstance(tree, int):
        return lambda columns: list(columns[0])
    kind, keys, children = tree
    if list(children) == list(range(len(children))):
        if kind == "tuple":
            return lambda columns: list(zip(*columns, strict=True))
        if kind == "list":
            return lambda columns: [list(values) for values in zip(*columns, strict=True)]
        return lambda columns: [dict(zip(keys, values, strict=True)) for values in zip(*columns, strict=True)]
    make = _maker(tree)
    return lambda columns: [make(values) for values in zip(*columns, strict=True)]


def _maker(node: Node) -> Callable[[Sequence[Any]], Any]:
    if isinstance(node, int):
        return lambda values: values[node]
    kind, keys, children = node
    makers = [_maker(child) for child in children]
    if kind == "tuple":
        return lambda values: tuple(m(values) for m in makers)
    if kind == "list":
        return lambda values: [m(values) for m in makers]
    return lambda values: {k: m(values) for k, m in zip(keys, makers, strict=True)}
