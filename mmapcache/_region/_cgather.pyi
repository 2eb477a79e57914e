# The compiled gather (_cgather.c): optional, built by setup.py when a C compiler is there.
from collections.abc import Callable
from typing import Any

def gather(
    region: Any,
    table: Any,
    width: int,
    indices: Any,
    rows: Any,
    dims: tuple[int, ...],
    unit: int,
    align: int,
    offsets: Any,
    shapes: Any,
    alloc: Callable[[tuple[int, ...]], Any],
    /,
) -> tuple[Any, list[int]]: ...
def pad(values: Any, offsets: Any, fill: Any, out: Any, /) -> None: ...
def take(
    table: Any,
    record: int,
    ready: int,
    indices: Any,
    sources: tuple[Any, ...],
    outs: tuple[Any, ...],
    hits: Any,
    length: int,
    at: int = 0,
    /,
) -> int: ...
def take_parts(
    parts: tuple[tuple[Any, int, int, Any, tuple[Any, ...], int, int], ...], outs: tuple[Any, ...], /
) -> tuple[int, ...]: ...
def deal(codes: Any, draws: tuple[Any, ...], out: Any, /) -> None: ...
def group(codes: Any, drawn: Any, sizes: Any, sources: int, order: Any, indices: Any, counts: Any, /) -> None: ...
def codes(start_phase: int, step: int, modulus: int, cuts: Any, out: Any, /) -> None: ...
def permute(state: int, inc: int, has_uint32: int, uinteger: int, out: Any, /) -> None: ...
