"""Length-aware batch forming: cut a window of items into batches by a cost budget.

Pure functions over item costs (and deadlines), so the rules can be tested and reasoned about
apart from the batch loop. A model declares an item's cost (``ManagedModel.item_cost``, e.g.
its token count) and a budget per batch (``max_batch_cost``); the loop reads a window of up to
two batches' worth, and :func:`cut` turns it into batches that run one after another.
"""

from __future__ import annotations

from collections.abc import Sequence

# A batch padded to its largest item (items x largest cost) may be more than PADDING_SHARE
# padding only while it is small: within SMALL_SHARE of the budget (splitting it would cost a
# model call for little padding saved).
PADDING_SHARE = 0.25
SMALL_SHARE = 0.125


def _cut_sorted(
    order: Sequence[int], costs: Sequence[int], batch_size: int, budget: int
) -> list[list[int]]:
    """Cut items (indices, sorted by cost) into consecutive batches."""
    small = budget * SMALL_SHARE
    batches: list[list[int]] = []
    batch: list[int] = []
    total = 0
    for index in order:
        cost = costs[index]
        if batch:
            # sorted ascending: this item is the batch's largest once it joins
            count = len(batch) + 1
            padded = count * cost
            full = count > batch_size or total + cost > budget
            wasteful = padded > small and padded - (total + cost) > PADDING_SHARE * padded
            if full or wasteful:
                batches.append(batch)
                batch, total = [], 0
        batch.append(index)
        total += cost
    if batch:
        batches.append(batch)
    return batches


def cut(
    costs: Sequence[int],
    deadlines: Sequence[float],
    batch_size: int,
    budget: int,
    urgent_before: float = float("-inf"),
) -> list[list[int]]:
    """Cut a window of items into batches, in the order they should run.

    Items are sorted by cost and cut in that order, so that each batch holds items of similar
    cost: a batch is closed before an item that would take it over ``batch_size`` items or
    over ``budget`` (the sum of its items' costs), or that would make the batch wasteful:
    padded to that item (items x its cost), the batch exceeds an eighth of the budget and more
    than a quarter of it would be padding. An item that costs more than the budget on its own
    is a batch of its own. Items whose deadline falls before ``urgent_before`` are cut apart
    from the others, so that they run first. Batches run by their earliest deadline (then by
    their earliest item: the window's order is arrival order).

    Returns lists of indices into ``costs``; each index appears in exactly one batch.
    """
    indices = range(len(costs))
    urgent = [i for i in indices if deadlines[i] < urgent_before]
    rest = [i for i in indices if deadlines[i] >= urgent_before] if urgent else list(indices)
    batches: list[list[int]] = []
    for group in (urgent, rest):
        if group:
            group.sort(key=lambda i: (costs[i], i))
            batches += _cut_sorted(group, costs, batch_size, budget)
    batches.sort(key=lambda batch: (min(deadlines[i] for i in batch), min(batch)))
    return batches


def padding(costs: Sequence[int]) -> int:
    """The padding a batch of these costs needs: items x the largest cost - the sum."""
    return len(costs) * max(costs) - sum(costs) if costs else 0
