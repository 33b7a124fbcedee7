"""gpu_worker.forming: cutting a window of items into batches by a cost budget."""

from __future__ import annotations

import random

from gpu_worker.forming import SMALL_SHARE, cut, padding

FAR = 1e12  # a deadline nobody reaches


def costs_of(batches: list[list[int]], costs: list[int]) -> list[list[int]]:
    return [[costs[i] for i in batch] for batch in batches]


def test_every_item_lands_in_exactly_one_batch_within_both_limits() -> None:
    rng = random.Random(1)
    for _ in range(200):
        costs = [rng.choice([rng.randint(1, 20), rng.randint(100, 256)]) for _ in range(60)]
        deadlines = [rng.uniform(0, 1000) for _ in costs]
        batches = cut(costs, deadlines, batch_size=16, budget=1024)
        assert sorted(i for batch in batches for i in batch) == list(range(len(costs)))
        for batch in batches:
            assert len(batch) <= 16
            assert sum(costs[i] for i in batch) <= 1024


def test_an_item_over_the_budget_runs_alone() -> None:
    costs = [5, 300, 5, 5]
    batches = cut(costs, [FAR] * 4, batch_size=8, budget=100)
    assert [1] in batches
    assert sorted(map(sorted, batches)) == [[0, 2, 3], [1]]


def test_similar_costs_are_grouped() -> None:
    costs = [10, 200, 12, 190, 11, 210, 9, 205]  # arrival order alternates short and long
    batches = costs_of(cut(costs, [FAR] * 8, batch_size=8, budget=4096), costs)
    assert sorted(map(sorted, batches)) == [[9, 10, 11, 12], [190, 200, 205, 210]]
    # in arrival order (count-based batching) one batch pads every short item to 210
    assert sum(padding(batch) for batch in batches) < padding(costs) / 10


def test_a_small_batch_takes_a_longer_item_rather_than_a_model_call_of_its_own() -> None:
    # padded, [2, 2, 2, 9] is 36 <= an eighth of the budget: not worth a batch of its own
    assert cut([2, 9, 2, 2], [FAR] * 4, batch_size=8, budget=400) == [[0, 2, 3, 1]]
    # over an eighth of the budget and more than a quarter padding: cut
    budget = 100
    costs = [2, 2, 2, 30]
    assert budget * SMALL_SHARE < 4 * 30
    assert sorted(cut(costs, [FAR] * 4, batch_size=8, budget=budget)) == [[0, 1, 2], [3]]


def test_batches_run_by_their_earliest_deadline_then_their_earliest_item() -> None:
    costs = [10, 10, 200, 200]
    assert cut(costs, [50.0, 60.0, 40.0, 70.0], batch_size=8, budget=1000) == [[2, 3], [0, 1]]
    assert cut(costs, [FAR] * 4, batch_size=8, budget=1000) == [[0, 1], [2, 3]]


def test_urgent_items_are_cut_apart_and_run_first() -> None:
    costs = [10, 10, 10, 200, 200]
    deadlines = [FAR, FAR, 5.0, FAR, FAR]  # item 2 must run soon: it leaves its group
    batches = cut(costs, deadlines, batch_size=8, budget=1000, urgent_before=10.0)
    assert batches == [[2], [0, 1], [3, 4]]


def test_padding() -> None:
    assert padding([]) == 0
    assert padding([3, 5, 5]) == 2
