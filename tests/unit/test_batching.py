"""Micro-batch planning by token budget."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from turnscale.learner.batching import accumulation_normaliser, pad_BT, plan_micro_batches


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=0, max_size=40), st.integers(1, 1000))
def test_plan_covers_every_sequence_once_within_the_budget(lengths, budget):
    plan = plan_micro_batches(lengths, budget)
    flat = [i for mb in plan for i in mb]
    assert sorted(flat) == list(range(len(lengths)))
    for mb in plan:
        padded = len(mb) * max(lengths[i] for i in mb)
        assert padded <= budget or len(mb) == 1  # only a lone over-long sequence may exceed it


def test_plan_sorts_longest_first_and_packs_similar_lengths():
    plan = plan_micro_batches([5, 100, 6, 98, 7], 200)
    assert plan == [[1, 3], [4, 2, 0]]


def test_pad_right_pads_with_the_value():
    t = pad_BT([np.array([1, 2, 3]), np.array([4])], pad_value=-1)
    assert t.tolist() == [[1, 2, 3], [4, -1, -1]]


def test_normaliser_divides_global_tokens_by_world_size():
    assert accumulation_normaliser(1000, 4) == 250.0
    assert accumulation_normaliser(0) == 1.0
