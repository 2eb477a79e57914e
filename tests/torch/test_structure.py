"""The structure <-> field-name codec: pure, so checked on plain ints as leaves, with Hypothesis."""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmapcache.torch._structure import BARE, Structure, name_leaves, name_of, parse_name, tree_from_names

SUPPORTED = "ints, or tuples/lists/dicts of them"


def is_leaf(value: Any) -> bool:
    return type(value) is int


def names(sample: Any) -> list[str]:
    return list(name_leaves(sample, is_leaf, supported=SUPPORTED))


def tagged(value: Any) -> Any:
    """``value`` with container kinds and dict key order made part of equality."""
    if isinstance(value, tuple):
        return ("tuple", [tagged(v) for v in value])
    if isinstance(value, list):
        return ("list", [tagged(v) for v in value])
    if isinstance(value, dict):
        return ("dict", [(k, tagged(v)) for k, v in value.items()])
    return value


def count_leaves(value: Any) -> int:
    if isinstance(value, (tuple, list)):
        return sum(map(count_leaves, value))
    if isinstance(value, dict):
        return sum(map(count_leaves, value.values()))
    return 1


AWKWARD_KEYS = ["a b", "0", "00", "[1]", "/", '"', "'", ".", "..", "a/b", "é", "キー", "\n", "\\", "a.b-c", "_", "x"]
keys = st.sampled_from(AWKWARD_KEYS) | st.text(min_size=1, max_size=8)
leaves = st.integers(-(2**70), 2**70)


def containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return (
        st.lists(children, min_size=1, max_size=4).map(tuple)
        | st.lists(children, min_size=1, max_size=4)
        | st.dictionaries(keys, children, min_size=1, max_size=4)
    )


samples = leaves | containers(leaves | containers(leaves))


@settings(max_examples=400)
@given(samples)
def test_names_rebuild_the_sample(sample: Any) -> None:
    by_name = name_leaves(sample, is_leaf, supported=SUPPORTED)
    assert len(by_name) == count_leaves(sample), "every leaf has a name of its own"
    for name in by_name:
        assert name_of(parse_name(name)) == name, "a name parses back to itself"
    structure = Structure(by_name)
    assert structure.flatten(sample, is_leaf, supported=SUPPORTED) == list(by_name.values())
    candidates = structure.candidates(sample)
    assert candidates is None or candidates == list(by_name.values()), "the fast path finds the same leaves"
    (rebuilt,) = structure.build([[leaf] for leaf in by_name.values()])
    assert tagged(rebuilt) == tagged(sample)
    # Columns of several samples build several samples.
    twice = structure.build([[leaf, -leaf] for leaf in by_name.values()])
    assert tagged(twice[0]) == tagged(sample)
    assert list(name_leaves(twice[1], is_leaf, supported=SUPPORTED).values()) == [-v for v in by_name.values()]


components = st.sampled_from(
    ["0", "1", "2", "00", "01", "[0]", "[1]", "[01]", "a", "b", '"a b"', '"a"', '""', "."]
) | st.text(max_size=4)
made_up = st.lists(st.lists(components, min_size=1, max_size=3).map("/".join), max_size=5)


@st.composite
def edited(draw: st.DrawFn) -> list[str]:
    """A valid name list, shuffled, with a name dropped, repeated or added (valid or not)."""
    names_ = draw(st.permutations(names(draw(samples))))
    edit = draw(st.sampled_from(["none", "drop", "repeat", "add"]))
    if edit == "drop":
        del names_[draw(st.integers(0, len(names_) - 1))]
    elif edit == "repeat":
        names_.append(draw(st.sampled_from(names_)))
    elif edit == "add":
        names_.append(draw(made_up.filter(bool))[0])
    return names_


name_lists = made_up | edited()


@settings(max_examples=600)
@given(name_lists)
def test_any_name_list_is_refused_or_describes_exactly_one_structure(candidates: list[str]) -> None:
    try:
        structure = Structure(candidates)
    except ValueError:
        return
    # Accepted: the sample whose leaves are the field positions is named exactly so.
    (sample,) = structure.build([[i] for i in range(len(candidates))])
    assert name_leaves(sample, is_leaf, supported=SUPPORTED) == {name: i for i, name in enumerate(candidates)}


# -- the naming existing cache files depend on ---------------------------------------------------


@pytest.mark.parametrize(
    ("sample", "expected"),
    [
        (7, ["."]),
        ((1, 2), ["0", "1"]),
        ([1, 2], ["[0]", "[1]"]),
        ({"image": 1, "label": 2}, ["image", "label"]),
        ({"a b": 1, "0": 2, "[1]": 3, "/": 4, '"': 5, ".": 6}, ['"a b"', '"0"', '"[1]"', '"/"', '"\\""', '"."']),
        ({"é": 1, "a.b-c_d": 2}, ['"\\u00e9"', "a.b-c_d"]),
        ((1, {"m": 2, "n": 3}), ["0", "1/m", "1/n"]),
        ([{"a": 1}, {"a": 2}], ["[0]/a", "[1]/a"]),
        ({"x": (1, 2), "y": [3]}, ["x/0", "x/1", "y/[0]"]),
        (tuple(range(11)), [str(i) for i in range(11)]),
    ],
)
def test_naming_is_as_documented(sample: Any, expected: list[str]) -> None:
    assert names(sample) == expected
    assert BARE == "."


NEITHER = "neither a position nor a dict key"


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ([], "no names"),
        (["0", "0"], "duplicate"),
        ([".", "0"], "bare leaf"),
        (["0", "[1]"], "cannot be a list and a tuple"),
        (["0", "a"], "cannot be a dict and a tuple"),
        (["1"], r"positions \[1\] are not 0..0"),
        (["0", "2"], r"positions \[0, 2\] are not 0..1"),
        (["00"], NEITHER),  # one spelling per name
        (["[01]"], NEITHER),
        (["-1"], NEITHER),
        (["\u0661"], NEITHER),  # a non-ASCII digit is no position
        (["'a'"], NEITHER),
        (["a b"], NEITHER),  # must be quoted
        (["0/"], NEITHER),
        (["/0"], NEITHER),
        (["0//a"], NEITHER),
        (['"a"'], "not how a dict key is quoted"),  # a simple key is never quoted
        (['""'], "not how a dict key is quoted"),  # nor empty
        (['"é"'], "not how a dict key is quoted"),  # JSON escapes non-ASCII: "\\u00e9"
        (['"a'], "JSON string"),
        (['"a b"x'], "separated by '/'"),
        (["0/0/0"], "nest at most 1 level"),
        (["0", "0/a"], "both a leaf and a container"),
    ],
)
def test_invalid_name_sets_raise_value_error(bad: list[str], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        tree_from_names(bad)
    with pytest.raises(ValueError, match=why):
        Structure(bad)


# -- what is not a structure ------------------------------------------------------------------------


class Pair(NamedTuple):
    a: int
    b: int


@pytest.mark.parametrize(
    ("sample", "error", "words"),
    [
        ("text", TypeError, ["the sample", "str", SUPPORTED]),
        ((1, None), TypeError, ["field '1'", "NoneType"]),
        ((1, ([2],)), TypeError, ["field '1/0'", "nested more than one level"]),
        (Pair(1, 2), TypeError, ["Pair", "plain tuple"]),
        ({0: 1}, TypeError, ["strings", "0"]),
        ({"": 1}, TypeError, ["strings"]),
        ((1, ()), ValueError, ["field '1'", "empty tuple"]),
        ({}, ValueError, ["the sample", "empty dict"]),
    ],
)
def test_what_cannot_be_named_is_refused_with_its_place(sample: Any, error: type[Exception], words: list[str]) -> None:
    with pytest.raises(error) as info:
        names(sample)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    ("stored", "given", "words"),
    [
        ((1, 2), (1, 2, 3), ["the sample", "tuple with keys [0, 1]", "keys [0, 1, 2]"]),
        ((1, 2), [1, 2], ["a tuple", "the dataset gave list"]),
        ({"a": 1}, {"b": 1}, ["['a']", "['b']"]),
        ((1, {"m": 2}), (1, {"m": 2, "n": 3}), ["field '1'"]),
        ((1, 2), (1, "two"), ["field '1'", "str values cannot be cached"]),
        (1, (1,), ["field '.'", "tuple values"]),
    ],
)
def test_flatten_names_the_first_place_that_does_not_fit(stored: Any, given: Any, words: list[str]) -> None:
    structure = Structure(names(stored))
    with pytest.raises((TypeError, ValueError)) as info:
        structure.flatten(given, is_leaf, supported=SUPPORTED)
    for word in words:
        assert word in str(info.value)
