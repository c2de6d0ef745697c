"""``ShardedOrder``: the order equals its documented definition, and a draw does not rebuild the epoch.

The reference (:func:`reference_stream`) is written here from the definition in the class docstring,
not from the code: epoch ``e`` is ``range(n)`` shuffled by ``random.Random(f"{seed}/{e}")``, cut to
whole optimizer steps of ``micro_batch x world x accumulation`` examples; the epochs are laid end to
end as one global stream, each micro-batch takes its next ``micro_batch x world`` examples and rank
``r`` takes slice ``r`` of them. Runs and checkpoints written before the permutation was cached follow
this definition, so equality keeps their order and their resume.
"""

from __future__ import annotations

import random

import pytest

from ntl_scale.data import ShardedOrder


def reference_stream(n: int, per_step: int, seed: int, epochs: int) -> list[int]:
    """The global order of ``epochs`` epochs (every rank's micro-batches interleaved, rank 0 first)."""
    stream: list[int] = []
    for epoch in range(epochs):
        order = list(range(n))
        random.Random(f"{seed}/{epoch}").shuffle(order)
        stream += order[: n - n % per_step]
    return stream


def reference_micro_batch(stream: list[int], draw: int, rank: int, micro: int, world: int) -> list[int]:
    """Rank ``rank``'s part of the global micro-batch ``draw`` (counted from 0 over the whole run)."""
    start = draw * micro * world + rank * micro
    return stream[start : start + micro]


# (examples, micro-batch, ranks, accumulation, seed): remainders of 0, 2, 5, 1 and 13 per epoch
LAYOUTS = [(48, 4, 3, 1, 0), (50, 2, 2, 3, 5), (41, 3, 2, 2, 7), (37, 1, 4, 3, 11), (101, 8, 1, 11, 2)]


@pytest.mark.parametrize(("n", "micro", "world", "accumulation", "seed"), LAYOUTS)
def test_order_equals_the_definition_across_epochs_ranks_and_a_resume(n, micro, world, accumulation, seed):
    per_step = micro * world * accumulation
    draws = 3 * (n // per_step) * accumulation + accumulation  # three epochs and one step into the fourth
    stream = reference_stream(n, per_step, seed, epochs=4)
    orders = [ShardedOrder(n, micro, r, world, seed, accumulation) for r in range(world)]
    for draw in range(draws):
        for rank, order in enumerate(orders):
            assert order.next_indices() == reference_micro_batch(stream, draw, rank, micro, world), (draw, rank)
    # saved in the middle of an epoch, restored into fresh orders (the state is the position alone)
    stop = (n // per_step) * accumulation + accumulation + 1  # mid-step of epoch 1 when accumulation > 1
    first = [ShardedOrder(n, micro, r, world, seed, accumulation) for r in range(world)]
    for _ in range(stop):
        for order in first:
            order.next_indices()
    saved = first[0].position
    assert all(o.position == saved for o in first)
    resumed = [ShardedOrder(n, micro, r, world, seed, accumulation) for r in range(world)]
    for order in resumed:
        order.position = saved
    for draw in range(stop, draws):
        for rank, order in enumerate(resumed):
            assert order.next_indices() == reference_micro_batch(stream, draw, rank, micro, world), (draw, rank)
    # the same object moved back to an earlier epoch (its kept permutation is of a later one)
    again = resumed[-1]
    again.position = 0
    assert again.next_indices() == reference_micro_batch(stream, 0, world - 1, micro, world)


def test_a_resume_on_another_split_continues_the_definition():
    """Global batch 12 written as 4 x 3 ranks x 1 and resumed as 2 x 2 ranks x 3 mid-epoch: each step
    takes the reference's next 12 examples."""
    n, seed = 50, 5
    stream = reference_stream(n, 12, seed, epochs=3)
    first = [ShardedOrder(n, 4, r, 3, seed) for r in range(3)]
    for _ in range(5):
        for order in first:
            order.next_indices()
    resumed = [ShardedOrder(n, 2, r, 2, seed, accumulation=3) for r in range(2)]
    for order in resumed:
        order.position = first[0].position
    for step in range(5, 10):
        taken = [i for _ in range(3) for order in resumed for i in order.next_indices()]
        assert taken == stream[12 * step : 12 * (step + 1)]


def test_a_draw_shuffles_at_most_once_per_epoch(monkeypatch):
    """Work counted, not timed: ``random.Random.shuffle`` (the permutation routine) runs once per epoch
    entered, not once per micro-batch (before the permutation was kept: once per draw)."""
    calls: list[int] = []
    real = random.Random.shuffle

    def counted(self, x):
        calls.append(len(x))
        return real(self, x)

    monkeypatch.setattr(random.Random, "shuffle", counted)
    n, micro, world, accumulation = 1000, 4, 2, 2
    per_epoch_draws = n // (micro * world * accumulation) * accumulation  # 124 micro-batches an epoch
    order = ShardedOrder(n, micro, 1, world, seed=3, accumulation=accumulation)
    for _ in range(3 * per_epoch_draws):
        order.next_indices()
    assert calls == [n] * 3  # three epochs drawn: three permutations
    for _ in range(10):
        order.next_indices()
    assert len(calls) == 4  # the fourth epoch, entered by the first of these draws
    order.position -= 8 * micro * world  # moved back within the same epoch: its permutation is reused
    for _ in range(8):
        order.next_indices()
    assert len(calls) == 4
