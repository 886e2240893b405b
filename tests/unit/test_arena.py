"""``protocol.arena.Arena`` and how the codec sends arrays carved from one: a group whose
arrays tile a region of one buffer travels as that region (one zero-copy frame per arena
block), decodes equal to the original, and carries no byte but the arrays and their zeroed
padding; views that do not tile (a gap, an overlap, a misaligned offset) or a small region
fall back to the per-array layout, and every layout round-trips."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from turnscale.protocol import codec
from turnscale.protocol import messages as m
from turnscale.protocol.arena import ALIGN, Arena, BlockSizer
from tests.unit.message_examples import assert_same, episode

torch.set_num_threads(1)


def carve(ep: m.Episode, arena: Arena) -> m.Episode:
    """``ep`` with its four arrays made in ``arena`` (as ``actors/episode.py`` does)."""
    return m.Episode(token_ids=arena.array(ep.token_ids, np.int32), loss_mask=arena.array(ep.loss_mask, np.uint8),
                     logprobs=arena.array(ep.logprobs, np.float32), versions=arena.array(ep.versions, np.int32),
                     prompt_len=ep.prompt_len, turns=ep.turns, finish_reason=ep.finish_reason, reward=ep.reward,
                     success=ep.success, turn_limit=ep.turn_limit)


def group(eps: list[m.Episode]) -> m.TrajectoryGroup:
    return m.TrajectoryGroup(lease_id="l", actor_id="a", task=m.Task(env="babyai", data_idx=1), turn_limit=5, episodes=eps)


def data_bytes(frames) -> int:
    return sum(memoryview(f).cast("B").nbytes for f in frames[1:])


def test_arrays_are_aligned_hold_their_values_and_the_padding_is_zero():
    arena = Arena(first_block_bytes=72)
    a = arena.array([1, 2, 3], np.uint8)
    b = arena.array([1.5, -2.0], np.float32)
    c = arena.array(np.arange(5), np.int64)
    assert a.tolist() == [1, 2, 3] and b.tolist() == [1.5, -2.0] and c.tolist() == list(range(5))
    assert a.base is b.base is c.base  # one block
    base = a.base.__array_interface__["data"][0]
    offsets = [x.__array_interface__["data"][0] - base for x in (a, b, c)]
    assert offsets == [0, 8, 16] and all(o % ALIGN == 0 for o in offsets)
    a.base[56:72] = 0xFF  # stale bytes where the next arrays and their padding go
    d = arena.array([7], np.uint8)  # byte 56
    e = arena.array([9], np.int32)  # bytes 64-67, after 7 bytes of padding, zeroed
    f = arena.array([1], np.int64)  # would end past byte 72: a new block
    assert d.base is e.base is a.base and bytes(a.base[57:64]) == b"\0" * 7 and e.tolist() == [9]
    assert f.base is not a.base and arena.blocks == 2


def test_a_full_block_starts_a_larger_one_and_earlier_arrays_stay_valid():
    arena = Arena(first_block_bytes=1024)
    first = arena.array(np.arange(200), np.int32)  # 800 bytes
    second = arena.array(np.arange(300), np.int32)  # does not fit: a new block of 2048
    big = arena.array(np.arange(5000), np.int32)  # larger than the next block: a block of its size
    assert arena.blocks == 3 and first.base is not second.base is not big.base
    assert len(second.base) == 2048 and len(big.base) >= big.nbytes
    assert first.tolist() == list(range(200)) and second.tolist() == list(range(300))


def test_used_bytes_counts_every_block_and_its_padding():
    arena = Arena(first_block_bytes=1024)
    arena.array(np.arange(3), np.uint8)  # 3 bytes
    arena.array(np.arange(200), np.int32)  # 5 bytes of padding, then 800
    assert arena.used_bytes == 808
    arena.array(np.arange(300), np.int32)  # a new block: 1200 more, no padding carried over
    assert arena.blocks == 2 and arena.used_bytes == 2008


def test_a_sizer_that_saw_a_group_makes_the_next_one_like_it_travel_as_one_data_frame():
    """An actor's groups are alike: once the sizer has seen one, the next group of the same
    size fits the first block, so it is a header and one data frame (from a plain 1 MB
    arena, a 4 MB group takes three blocks, three frames)."""
    plain = group([episode(40_000 + 17 * i, seed=i) for i in range(8)])
    sizer = BlockSizer()
    first = sizer.arena()
    frames = codec.encode(group([carve(ep, first) for ep in plain.episodes]))
    assert first.blocks == 3 and len(frames) == 1 + 3
    sizer.observe(first)
    assert sizer.first_block_bytes() >= 1.25 * first.used_bytes and sizer.first_block_bytes() % (1 << 20) == 0
    second = sizer.arena()
    carved = group([carve(ep, second) for ep in plain.episodes])
    frames = codec.encode(carved)
    assert second.blocks == 1 and len(frames) == 2
    assert_same(plain, codec.decode([bytes(f) for f in frames]))


def test_a_sizer_stays_between_its_floor_and_cap_and_forgets_old_groups():
    sizer = BlockSizer(floor=1 << 20, cap=8 << 20, keep=2)
    assert sizer.first_block_bytes() == 1 << 20  # nothing seen yet
    big, small = Arena(64 << 20), Arena()
    big.array(np.zeros(40 << 20, np.uint8), np.uint8)
    small.array(np.zeros(1000, np.uint8), np.uint8)
    sizer.observe(big)
    assert sizer.first_block_bytes() == 8 << 20  # capped; a larger group grows blocks as before
    sizer.observe(small)
    sizer.observe(small)  # the big group has left the window of 2
    assert sizer.first_block_bytes() == 1 << 20
    with pytest.raises(ValueError):
        BlockSizer(floor=4 << 20, cap=1 << 20)


@pytest.mark.parametrize("n_episodes,tokens", [(8, 20_000), (3, 70_000), (8, 200)])
def test_a_group_carved_from_one_arena_travels_as_its_blocks_and_round_trips(n_episodes, tokens):
    arena = Arena()
    plain = group([episode(tokens + 17 * i, seed=i) for i in range(n_episodes)])
    carved = group([carve(ep, arena) for ep in plain.episodes])
    frames = codec.encode(carved)
    got = codec.decode([bytes(f) for f in frames])
    assert_same(plain, got)
    arrays = [a for ep in carved.episodes for a in (ep.token_ids, ep.loss_mask, ep.logprobs, ep.versions)]
    nbytes = sum(a.nbytes for a in arrays)
    if nbytes >= 2 * codec.OWN_FRAME_BYTES:
        assert len(frames) == 1 + arena.blocks  # header + one frame per block
        assert data_bytes(frames) < nbytes + ALIGN * len(arrays)  # nothing but the arrays and padding
    else:  # a small group: the per-array layout, exactly as for arrays of their own
        assert [bytes(f) for f in frames] == [bytes(f) for f in codec.encode(plain)]


def test_zero_copy_frames_view_the_arena():
    arena = Arena()
    carved = group([carve(episode(30_000, seed=i), arena) for i in range(4)])
    frames = codec.encode(carved)
    block = carved.episodes[0].token_ids.base
    first = np.frombuffer(frames[1], np.uint8)
    assert np.shares_memory(first, block)


def test_views_that_do_not_tile_fall_back_to_the_per_array_layout_and_round_trip():
    """A gap (an episode's arrays in the arena but not in the message), an overlap (one
    array sent in two fields) and an offset not aligned to the item size (the decoder
    would refuse it) each fall back; the message still round-trips."""
    arena = Arena()
    eps = [carve(episode(30_000, seed=i), arena) for i in range(3)]
    gap = group([eps[0], eps[2]])
    frames = codec.encode(gap)
    assert len(frames) > 1 + arena.blocks and data_bytes(frames) < sum(
        a.nbytes for ep in gap.episodes for a in (ep.token_ids, ep.loss_mask, ep.logprobs, ep.versions)) + 64
    assert_same(gap, codec.decode([bytes(f) for f in frames]))

    e = eps[0]
    overlap = group([m.Episode(token_ids=e.token_ids, loss_mask=e.loss_mask, logprobs=e.logprobs, versions=e.token_ids,
                               prompt_len=e.prompt_len, turns=e.turns, finish_reason=e.finish_reason, reward=e.reward,
                               success=e.success, turn_limit=e.turn_limit)])
    assert_same(overlap, codec.decode([bytes(f) for f in codec.encode(overlap)]))

    n = 100_001  # one buffer: a uint8 mask at byte 0, then int32 ids at byte n (tiling, but not 4-aligned)
    buf = np.zeros(5 * n, np.uint8)
    buf[n:] = np.arange(4 * n, dtype=np.int64).astype(np.uint8)
    odd = group([m.Episode(token_ids=buf[n:].view(np.int32), loss_mask=buf[:n], logprobs=np.zeros(n, np.float32),
                           versions=np.full(n, -1, np.int32), prompt_len=1, turns=[], finish_reason="done", reward=0.0,
                           success=False, turn_limit=5)])
    frames = codec.encode(odd)
    assert len(frames) == 5  # a frame per array, not the buffer's region
    assert_same(odd, codec.decode([bytes(f) for f in frames]))


def test_run_group_sizes_each_groups_arena_from_the_groups_before():
    """``actors.episode.run_group`` takes its arena from ``GROUP_BLOCKS`` and reports the
    finished group's bytes to it."""
    import trio

    from turnscale.actors import episode as ep_mod

    seen = []

    class Sizer(BlockSizer):
        def arena(self) -> Arena:
            seen.append("arena")
            return super().arena()

        def observe(self, arena: Arena) -> None:
            seen.append(arena.used_bytes)
            super().observe(arena)

    old, ep_mod.GROUP_BLOCKS = ep_mod.GROUP_BLOCKS, Sizer()
    try:
        async def play(**kw):
            st = ep_mod.EpisodeState()
            st.add_context(list(range(10)))
            st.add_sampled(np.arange(5, dtype=np.int32), np.full(5, -0.5, np.float32), np.full(5, 2, np.int32))
            ctx = ep_mod.EpisodeContext(engine=None, renderer=None, env=None, parser=None, sampling=None, turn_limit=3,
                                        seed=0, stop_ids=(), arena=kw["arena"])
            return st.episode(ctx, ep_mod.EpisodeEnd("done"))

        real, ep_mod.run_episode = ep_mod.run_episode, play
        try:
            lease = m.Lease(lease_id="l", task=m.Task(env="babyai", data_idx=1), group_size=2, seed=3, turn_limit=3,
                            policy_version=0, ttl_s=60.0)
            g = trio.run(lambda: ep_mod.run_group(engine=None, renderer=None, sessions=lambda i: None, lease=lease,
                                                  actor_id="a", sampling=None, parser=None, prompt=""))
        finally:
            ep_mod.run_episode = real
    finally:
        ep_mod.GROUP_BLOCKS = old
    assert len(g.episodes) == 2 and not g.failed
    arrays = [a for ep in g.episodes for a in (ep.token_ids, ep.loss_mask, ep.logprobs, ep.versions)]
    assert seen[0] == "arena" and len(seen) == 2 and len({id(a.base) for a in arrays}) == 1
    assert sum(a.nbytes for a in arrays) <= seen[1] < sum(a.nbytes for a in arrays) + ALIGN * len(arrays)


def test_the_actor_builds_a_group_in_one_arena():
    """``actors.episode.EpisodeState.episode`` carves from the context's arena."""
    from turnscale.actors.episode import EpisodeContext, EpisodeEnd, EpisodeState

    arena = Arena()
    ctx = EpisodeContext(engine=None, renderer=None, env=None, parser=None, sampling=None, turn_limit=3, seed=0,
                         stop_ids=(), arena=arena)
    eps = []
    for i in range(2):
        st = EpisodeState()
        st.add_context(list(range(10 + i)))
        st.add_sampled(np.arange(5, dtype=np.int32), np.full(5, -0.5, np.float32), np.full(5, 2, np.int32))
        eps.append(st.episode(ctx, EpisodeEnd("done")))
    bases = {id(a.base) for ep in eps for a in (ep.token_ids, ep.loss_mask, ep.logprobs, ep.versions)}
    assert len(bases) == 1 and eps[1].token_ids.tolist() == list(range(11)) + list(range(5))
    assert eps[1].loss_mask.tolist() == [0] * 11 + [1] * 5 and eps[0].versions.tolist() == [-1] * 10 + [2] * 5
