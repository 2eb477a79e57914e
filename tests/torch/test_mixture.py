"""``Mixture``: the draws (proportions in every window, schedules, passes), the dataset, and its loader in process."""

from __future__ import annotations

import pickle
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from mixture_run import SIZES, WEIGHTS, Corpus, expected_ids, ids, make_mixture

from mmapcache.torch import CachedDataset, Mixture
from mmapcache.torch._draws import BLOCK, floor_sum

WINDOW = 10_000


def _window_error(codes: np.ndarray[Any, Any], code: int, weight: float) -> float:
    """The largest gap, in percentage points, between ``weight`` and a source's share of any WINDOW positions."""
    running = np.concatenate([[0], np.cumsum(codes == code)])
    shares = (running[WINDOW:] - running[:-WINDOW]) / WINDOW
    return float(np.abs(shares - weight).max()) * 100


def _sources(sizes: dict[str, int]) -> dict[str, range]:
    return {name: range(size) for name, size in sizes.items()}


def test_floor_sum_is_the_sum_it_names() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        n, m, a, b = (int(v) for v in rng.integers(0, 400, 4))
        m += 1
        assert floor_sum(n, m, a, b) == sum((a * i + b) // m for i in range(n))


@pytest.mark.parametrize("seed", [0, 1, 2**64 - 1])
def test_proportions_hold_within_half_a_point_in_every_window_of_10000(seed: int) -> None:
    mixture = Mixture(_sources({"web": 5000, "code": 700, "math": 90}), WEIGHTS, seed=seed)
    codes, _ = mixture.draws(0, 300_000)
    for code, weight in enumerate(WEIGHTS.values()):
        assert _window_error(codes, code, weight) <= 0.5
    # Far along a run as well: the draws there are computed, not walked to.
    codes, _ = mixture.draws(10**12, 10**12 + 50_000)
    for code, weight in enumerate(WEIGHTS.values()):
        assert _window_error(codes, code, weight) <= 0.5


def test_independent_draws_would_not_hold_the_proportions() -> None:
    """The target is beyond i.i.d. sampling: its 10,000-sample windows stray by over a point at p = 0.7."""
    codes = np.random.default_rng(0).choice(3, size=300_000, p=list(WEIGHTS.values()))
    assert _window_error(codes, 0, 0.7) > 1.0


def test_a_schedule_is_followed_from_the_block_where_it_changes() -> None:
    change = 40 * BLOCK

    def weights(position: int) -> dict[str, float]:
        return WEIGHTS if position < change else {"web": 0.2, "code": 0.3, "math": 0.5}

    mixture = Mixture(_sources({"web": 5000, "code": 700, "math": 90}), weights, seed=3)
    codes, indices = mixture.draws(0, 2 * change)
    for code, weight in enumerate(WEIGHTS.values()):
        assert _window_error(codes[:change], code, weight) <= 0.5
    for code, weight in enumerate((0.2, 0.3, 0.5)):
        assert _window_error(codes[change:], code, weight) <= 0.5
    assert mixture.weights_at(change - 1) == pytest.approx(WEIGHTS)
    assert mixture.weights_at(change) == pytest.approx({"web": 0.2, "code": 0.3, "math": 0.5})
    # Every position is a function of itself alone, on a fresh mixture, in any order.
    fresh = Mixture(_sources({"web": 5000, "code": 700, "math": 90}), weights, seed=3)
    for position in (2 * change - 1, 5, change, change + 777, 0):
        name, index = fresh.source(position)
        assert (mixture.names.index(name), index) == (codes[position], indices[position])


def test_a_schedule_can_switch_a_source_off_and_on() -> None:
    def weights(position: int) -> dict[str, float]:
        return {"a": 1.0} if (position // (4 * BLOCK)) % 2 else {"a": 1.0, "b": 1.0}

    codes, _ = Mixture(_sources({"a": 10, "b": 10}), weights).draws(0, 16 * BLOCK)
    blocks = codes.reshape(-1, 4 * BLOCK)
    assert (blocks[1::2] == 0).all()
    assert np.abs((blocks[0::2] == 1).mean(axis=1) - 0.5).max() < 0.01


def test_the_draws_are_a_function_of_seed_and_position() -> None:
    sources = _sources({"web": 1000, "code": 300, "math": 50})
    mixture = Mixture(sources, WEIGHTS, seed=7)
    codes, indices = mixture.draws(0, 20_000)
    for position in np.random.default_rng(1).integers(0, 20_000, 50).tolist():
        name, index = Mixture(sources, WEIGHTS, seed=7).source(position)
        assert (mixture.names.index(name), index) == (codes[position], indices[position])
    got = mixture.draws_at([19_999, 3, 3, 12_345])
    assert got[0].tolist() == codes[[19_999, 3, 3, 12_345]].tolist()
    assert got[1].tolist() == indices[[19_999, 3, 3, 12_345]].tolist()
    other, _ = Mixture(sources, WEIGHTS, seed=8).draws(0, 20_000)
    assert not np.array_equal(other, codes), "another seed draws other sources"


@pytest.mark.parametrize("kind", ["static", "schedule", "replacement"])
def test_drawing_ahead_changes_no_draw_and_keeps_its_arrays_its_own(kind: str) -> None:
    sources = _sources({"web": 700, "code": 90, "math": 13})
    weights: Any = WEIGHTS if kind != "schedule" else (lambda p: WEIGHTS if p < 3 * BLOCK else {"web": 1, "math": 3})
    make = lambda: Mixture(sources, weights, seed=5, replacement=kind == "replacement")  # noqa: E731
    fresh, ahead = make(), make()
    rng = np.random.default_rng(3)
    position = 0
    for _ in range(60):
        if rng.random() < 0.2:
            ahead.draw_ahead(position, position + int(rng.integers(1, 5000)))
        size = int(rng.integers(1, 700))
        got, want = ahead.by_source(position, position + size), fresh.by_source(position, position + size)
        assert [part.tolist() for part in got] == [part.tolist() for part in want]
        position += size + int(rng.integers(0, 2)) * int(rng.integers(0, 3000))
    ahead.draw_ahead(0, 4000)
    codes, _ = ahead.draws(100, 200)
    codes[:] = 99  # a caller's copy: the window is not changed
    assert ahead.draws(100, 200)[0].tolist() == fresh.draws(100, 200)[0].tolist()


@pytest.mark.parametrize("kind", ["static", "schedule"])
def test_grouping_many_ranges_at_once_groups_each_as_by_source_does(kind: str) -> None:
    sources = _sources({"web": 700, "code": 90, "math": 13})
    weights: Any = WEIGHTS if kind == "static" else (lambda p: WEIGHTS if p < 3 * BLOCK else {"web": 1, "math": 3})
    mixture, fresh = Mixture(sources, weights, seed=4), Mixture(sources, weights, seed=4)
    rng = np.random.default_rng(kind == "static")
    for layout in ["one after another", "gaps", "far apart", "overlapping", "empty ones"]:
        starts = np.cumsum(rng.integers(1, 300, 40)) + int(rng.integers(0, 5000))
        if layout == "one after another":
            stops = np.append(starts[1:], starts[-1] + 17)
        elif layout == "far apart":
            starts = starts * 1000
            stops = starts + rng.integers(1, 9, 40)
        elif layout == "overlapping":
            stops = starts + rng.integers(1, 900, 40)
        else:
            stops = starts + rng.integers(0 if layout == "empty ones" else 1, 200, 40)
        if layout == "gaps":
            mixture.draw_ahead(int(starts[0]), int(stops[-1]))  # from a window drawn ahead, or not
        positions, counts, indices = mixture.by_sources(starts.tolist(), stops.tolist())
        assert counts.shape == (40, 3)
        at = 0
        for k, (lo, hi) in enumerate(zip(starts.tolist(), stops.tolist(), strict=True)):
            want = fresh.by_source(lo, hi)
            size = max(hi - lo, 0)
            assert positions[at : at + size].tolist() == want[0].tolist(), (layout, k)
            assert counts[k].tolist() == want[1].tolist()
            assert indices[at : at + size].tolist() == want[2].tolist()
            at += size
        assert at == len(positions) == len(indices)
    with pytest.raises(TypeError, match="as many integer positions"):
        mixture.by_sources([0, 5], [3])
    with pytest.raises(TypeError, match="as many integer positions"):
        mixture.by_sources([0.5], [3])
    with pytest.raises(IndexError, match=">= 0"):
        mixture.by_sources([-1], [3])


def test_without_replacement_each_pass_of_a_source_is_a_fresh_permutation() -> None:
    mixture = Mixture(_sources({"web": 200, "code": 60, "math": 15}), WEIGHTS, seed=2)
    codes, indices = mixture.draws(0, 30_000)
    for code, size in enumerate((200, 60, 15)):
        drawn = indices[codes == code]
        passes = [drawn[k : k + size].tolist() for k in range(0, len(drawn) - size + 1, size)]
        assert len(passes) >= 10
        assert all(sorted(one) == list(range(size)) for one in passes)
        assert len({tuple(one) for one in passes}) == len(passes), "each pass is a new permutation"


def test_with_replacement_indices_are_drawn_uniformly() -> None:
    mixture = Mixture(_sources({"a": 50, "b": 10}), {"a": 1, "b": 1}, seed=4, replacement=True)
    codes, indices = mixture.draws(0, 100_000)
    counts = np.bincount(indices[codes == 0], minlength=50)
    expected = (codes == 0).sum() / 50
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 100  # 49 degrees of freedom: p < 1e-5 above 100
    first_pass = indices[codes == 0][:50]
    assert len(set(first_pass.tolist())) < 50, "with replacement, a run of draws repeats indices"


def test_an_item_is_the_sample_of_its_source(cache_dir: Path) -> None:
    mixture = make_mixture(cache_dir)
    for position in (0, 1, 17, 999, 123_456):
        name, index = mixture.source(position)
        assert ids({key: value[None] for key, value in mixture[position].items()}) == [
            list(SIZES).index(name) * 10**6 + index
        ]
    positions = [5, 400, 3, 77, 5]
    samples = mixture.__getitems__(positions)
    assert [int(sample["id"]) for sample in samples] == [expected_ids(401)[p] for p in positions]


def test_a_mixture_pickles_as_its_sources_weights_and_seed(cache_dir: Path) -> None:
    mixture = make_mixture(cache_dir, scheduled=True)
    again = pickle.loads(pickle.dumps(mixture))
    assert again.draws(0, 5000)[0].tolist() == mixture.draws(0, 5000)[0].tolist()
    assert again.draws(0, 5000)[1].tolist() == mixture.draws(0, 5000)[1].tolist()


@pytest.mark.parametrize(
    ("weights", "error", "words"),
    [
        ({"web": -1.0}, ValueError, "finite and >= 0"),
        ({"web": float("nan")}, ValueError, "finite and >= 0"),
        ({"web": 0.0, "code": 0}, ValueError, "all 0"),
        ({"web": 1.0, "books": 1.0}, ValueError, "not among"),
        ({"web": "1"}, TypeError, "must be a number"),
        ([0.7, 0.3], TypeError, "must map source names"),
    ],
)
def test_wrong_weights_are_refused_with_what_to_give(weights: Any, error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words):
        Mixture({"web": range(3), "code": range(3)}, weights)


def test_wrong_sources_and_positions_are_refused() -> None:
    with pytest.raises(TypeError, match="names must be strings"):
        Mixture({0: range(3)}, {0: 1.0})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="has no samples"):
        Mixture({"a": range(3), "b": range(0)}, {"a": 1, "b": 1})
    Mixture({"a": range(3), "b": range(0)}, {"a": 1})  # an empty source of weight 0 is never drawn
    mixture = Mixture({"a": range(3)}, {"a": 1})
    with pytest.raises(IndexError, match=">= 0"):
        mixture.source(-1)
    with pytest.raises(TypeError, match="integer"):
        mixture.source(1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at position 1024"):
        Mixture({"a": range(3)}, lambda p: {"a": 1.0 if p < BLOCK else -1.0}).draws(0, 2 * BLOCK)


# -- the loader ------------------------------------------------------------------------


def _run(loader: Any) -> list[list[int]]:
    return [ids(batch) for batch in loader]


def _grouped(batch: list[int]) -> list[int]:
    """A batch's ids as the loader orders them: by source, each source's in position order."""
    return sorted(batch, key=lambda i: i // 10**6)


def test_a_pass_over_the_loader_reads_every_position_once_grouped_by_source(cache_dir: Path) -> None:
    mixture = make_mixture(cache_dir)
    batches = _run(mixture.loader(8, num_samples=400))
    expected = expected_ids(400)
    assert [i for batch in batches for i in batch] == [
        i for k in range(0, 400, 8) for i in _grouped(expected[k : k + 8])
    ]
    assert all(_grouped(batch) == batch for batch in batches), "a batch's sources come in the order of datasets"
    # The next pass reads the next positions.
    more = _run(mixture.loader(8, num_samples=400))
    assert more == batches, "a new loader starts at position 0"
    loader = mixture.loader(8, num_samples=400)
    _run(loader)
    assert Counter(i for batch in _run(loader) for i in batch) == Counter(expected_ids(800)[400:])
    assert loader.state_dict()["position"] == 800


@pytest.mark.parametrize("cached", [True, False], ids=["caches", "plain"])
def test_batches_from_the_files_equal_the_collated_samples(cache_dir: Path, cached: bool) -> None:
    mixture = make_mixture(cache_dir, cached=cached)
    loader = mixture.loader(16, num_samples=320)
    plain = make_mixture(None, cached=False)
    for positions, batch in zip(loader.batch_sampler, loader, strict=True):
        want = torch.utils.data.default_collate(plain.__getitems__(positions))
        assert batch.keys() == want.keys()
        assert all(torch.equal(batch[key], want[key]) and batch[key].dtype == want[key].dtype for key in want)


def test_workers_give_the_same_batches(cache_dir: Path) -> None:
    mixture = make_mixture(cache_dir)
    alone = _run(mixture.loader(8, num_samples=320))
    for directory in ("cold", "warm"):
        with_workers = make_mixture(cache_dir / "w") if directory == "cold" else mixture
        (cache_dir / "w").mkdir(exist_ok=True, mode=0o700)
        loader = with_workers.loader(8, num_samples=320, num_workers=2, multiprocessing_context="fork")
        assert _run(loader) == alone, directory


def test_ranks_take_their_share_of_each_step(cache_dir: Path) -> None:
    mixture = make_mixture(cache_dir)
    expected = expected_ids(640)
    per_rank = [_run(mixture.loader(8, num_samples=640, rank=r, world_size=4)) for r in range(4)]
    assert [len(batches) for batches in per_rank] == [20] * 4
    for step in range(20):
        for rank in range(4):
            lo = step * 32 + rank * 8
            assert per_rank[rank][step] == _grouped(expected[lo : lo + 8])


def test_a_short_last_step_is_split_among_the_ranks(cache_dir: Path) -> None:
    mixture = make_mixture(cache_dir)
    per_rank = [_run(mixture.loader(8, num_samples=70, rank=r, world_size=3)) for r in range(3)]
    assert sorted(i for batches in per_rank for batch in batches for i in batch) == sorted(expected_ids(70))
    assert [len(batches[-1]) for batches in per_rank] == [7, 7, 8]  # 22 left after 2 steps of 24
    assert [len(mixture.loader(8, num_samples=70, rank=r, world_size=3)) for r in range(3)] == [3, 3, 3]
    # Two positions left for three ranks: rank 0's share of the last step is empty.
    per_rank = [_run(mixture.loader(8, num_samples=50, rank=r, world_size=3)) for r in range(3)]
    assert [len(batches) for batches in per_rank] == [2, 3, 3]
    assert [len(mixture.loader(8, num_samples=50, rank=r, world_size=3)) for r in range(3)] == [2, 3, 3]
    assert sorted(i for batches in per_rank for batch in batches for i in batch) == sorted(expected_ids(50))


@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 4), (3, 3), (1, 5)])
def test_a_state_resumes_on_another_number_of_ranks_with_nothing_twice_or_skipped(
    cache_dir: Path, before: int, after: int
) -> None:
    mixture = make_mixture(cache_dir, scheduled=True)
    total, steps = 3000, 5
    loaders = [mixture.loader(8, num_samples=total, rank=r, world_size=before, stateful=True) for r in range(before)]
    seen: list[int] = []
    for loader in loaders:
        for step, batch in enumerate(loader, start=1):
            seen += ids(batch)
            if step == steps:
                break
    state = loaders[0].state_dict()
    assert all(loader.state_dict() == state for loader in loaders), "ranks in step have one state"
    assert state["position"] == steps * 8 * before
    resumed = [mixture.loader(8, num_samples=total, rank=r, world_size=after, stateful=True) for r in range(after)]
    for loader in resumed:
        loader.load_state_dict(state)
        seen += [i for batch in _run(loader) for i in batch]
    assert Counter(seen) == Counter(expected_ids(total, scheduled=True))
    if before == after:
        whole = [_run(mixture.loader(8, num_samples=total, rank=r, world_size=after)) for r in range(after)]
        resumed_again = [mixture.loader(8, num_samples=total, rank=r, world_size=after) for r in range(after)]
        for rank, loader in enumerate(resumed_again):
            loader.load_state_dict(state)
            assert _run(loader) == whole[rank][steps:]


def test_a_state_of_another_mixture_is_refused(cache_dir: Path) -> None:
    state = make_mixture(cache_dir).loader(8, num_samples=80).state_dict()
    other = Mixture({"web": Corpus(0, 300)}, {"web": 1.0}, seed=5).loader(8)
    with pytest.raises(ValueError, match="another mixture"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="not the state"):
        other.load_state_dict({"epoch": 3})


def test_loader_arguments_are_checked(cache_dir: Path) -> None:
    mixture = make_mixture(cache_dir)
    with pytest.raises(TypeError, match="no shuffle="):
        mixture.loader(8, shuffle=True)
    with pytest.raises(ValueError, match="batch_size"):
        mixture.loader(0)
    with pytest.raises(ValueError, match="rank"):
        mixture.loader(8, rank=2, world_size=2)
    with pytest.raises(TypeError, match="no end"):
        len(mixture.loader(8))
    assert len(mixture.loader(8, num_samples=100, world_size=2, rank=0)) == 7


def test_a_collate_fn_of_yours_receives_the_samples(cache_dir: Path) -> None:
    mixture = make_mixture(cache_dir)
    batches = list(mixture.loader(4, num_samples=8, collate_fn=lambda samples: [int(s["id"]) for s in samples]))
    assert [i for batch in batches for i in batch] == [i for k in (0, 4) for i in _grouped(expected_ids(8)[k : k + 4])]


def test_sources_of_different_fields_are_refused_in_one_batch(cache_dir: Path) -> None:
    class Other(Corpus):
        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            return {"id": torch.tensor(index), "x": torch.zeros(4, dtype=torch.uint8)}

    sources = {
        "a": CachedDataset(Corpus(0, 50), cache_dir / "a.mmc", key="a"),
        "b": CachedDataset(Other(1, 50), cache_dir / "b.mmc", key="b"),
    }
    mixture = Mixture(sources, {"a": 1, "b": 1})
    sources["a"][0], sources["b"][0]
    with pytest.raises(ValueError, match="different fields"):
        _run(mixture.loader(8, num_samples=8))


def test_spawned_workers_get_the_mixture_by_pickle(cache_dir: Path) -> None:
    mixture = make_mixture(cache_dir, scheduled=True)
    loader = mixture.loader(8, num_samples=64, num_workers=1, multiprocessing_context="spawn")
    assert _run(loader) == _run(mixture.loader(8, num_samples=64))


@pytest.mark.parametrize("sources", [1, 3, 8, 9, 40])
def test_the_tally_of_codes_is_their_bincount(sources: int) -> None:
    from mmapcache.torch._draws import tally

    codes = np.random.default_rng(sources).integers(0, sources, 5000).astype(np.int64)
    assert tally(codes, sources).tolist() == np.bincount(codes, minlength=sources).tolist()
    assert tally(codes[:0], sources).tolist() == [0] * sources
