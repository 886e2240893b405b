"""Packed out-of-band arrays (schema 5), property-tested with hypothesis: any mix of
episode lengths and thresholds round-trips exactly; any edit of an array's frame,
offset or shape, and any cut or padding of the data frame, is either refused with a
``ProtocolError`` or decodes to arrays that lie inside the frames without overlapping."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnscale.protocol import codec
from turnscale.protocol import messages as m
from turnscale.protocol.errors import ProtocolError
from tests.unit.message_examples import assert_same, episode

pytestmark = pytest.mark.timeout(120)

_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _group(lengths: list[int]) -> m.TrajectoryGroup:
    eps = [episode(n, seed=i) for i, n in enumerate(lengths)]
    return m.TrajectoryGroup(lease_id="l", actor_id="a", task=m.Task(env="babyai", data_idx=1), turn_limit=5, episodes=eps)


@_SETTINGS
@given(lengths=st.lists(st.integers(1, 3000), min_size=1, max_size=6),
       oob=st.sampled_from([0, 1, 512, 4096, 1 << 40]), own=st.sampled_from([1, 1024, 8192, 1 << 40]))
def test_any_group_round_trips_whatever_the_thresholds(lengths, oob, own):
    msg = _group(lengths)
    frames = codec.encode(msg, out_of_band_bytes=oob, own_frame_bytes=own)
    got = codec.decode([bytes(f) for f in frames])
    assert_same(msg, got)
    packed = sum(1 for ep in msg.episodes for a in (ep.token_ids, ep.loss_mask, ep.logprobs, ep.versions)
                 if oob <= a.nbytes < own)
    own_frames = sum(1 for ep in msg.episodes for a in (ep.token_ids, ep.loss_mask, ep.logprobs, ep.versions)
                     if a.nbytes >= max(oob, own))
    assert len(frames) == 1 + own_frames + (1 if packed else 0)


@_SETTINGS
@given(lengths=st.lists(st.integers(1, 3000), min_size=1, max_size=6), skip=st.integers(-1, 5),
       oob=st.sampled_from([0, 1, 512, 4096, 1 << 40]), own=st.sampled_from([1, 1024, 8192, 1 << 40]),
       block=st.sampled_from([8, 4096, 1 << 20]))
def test_any_group_carved_from_an_arena_round_trips_whatever_the_thresholds(lengths, skip, oob, own, block):
    """Arrays from one ``protocol.arena.Arena`` (as the actor makes them), with episode
    ``skip`` carved but left out of the message (a gap), and arena blocks of any size."""
    from turnscale.protocol.arena import Arena

    arena = Arena(first_block_bytes=block)
    eps = []
    for i, n in enumerate(lengths):
        e = episode(n, seed=i)
        arrays = {f: arena.array(getattr(e, f), getattr(e, f).dtype) for f in ("token_ids", "loss_mask", "logprobs", "versions")}
        if i != skip:
            eps.append(m.Episode(**{**{f.name: getattr(e, f.name) for f in dataclasses.fields(e)}, **arrays}))
    msg = m.TrajectoryGroup(lease_id="l", actor_id="a", task=m.Task(env="babyai", data_idx=1), turn_limit=5, episodes=eps)
    frames = codec.encode(msg, out_of_band_bytes=oob, own_frame_bytes=own)
    assert_same(msg, codec.decode([bytes(f) for f in frames]))


def _exts(node: Any, path: tuple = ()) -> list[tuple]:
    """Paths of every array ext in a decoded envelope body."""
    if isinstance(node, msgpack.ExtType):
        return [path]
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _exts(v, path + (k,))]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in _exts(v, path + (i,))]
    return []


def _at(node: Any, path: tuple) -> Any:
    for p in path:
        node = node[p]
    return node


@_SETTINGS
@given(lengths=st.lists(st.integers(1, 600), min_size=1, max_size=4), data=st.data())
def test_edited_array_references_are_refused_or_stay_inside_their_frames(lengths, data):
    frames = [bytes(f) for f in codec.encode(_group(lengths), out_of_band_bytes=0, own_frame_bytes=1 << 40)]
    env = msgpack.unpackb(frames[0], raw=False, ext_hook=lambda c, d: msgpack.ExtType(c, d))
    paths = _exts(env["b"])
    path = data.draw(st.sampled_from(paths))
    meta = msgpack.unpackb(_at(env["b"], path).data, raw=False)
    field = data.draw(st.sampled_from(["frame", "offset", "shape", "cut", "pad"]))
    value = data.draw(st.integers(-3, 5000))
    if field == "frame":
        meta[2] = value
    elif field == "offset":
        meta[3] = value
    elif field == "shape":
        meta[1] = [value]
    _at(env["b"], path[:-1])[path[-1]] = msgpack.ExtType(codec.ARRAY_FRAME, msgpack.packb(meta))
    data_frame = frames[1]
    if field == "cut":
        data_frame = data_frame[: max(len(data_frame) - abs(value), 0)]
    elif field == "pad":
        data_frame = data_frame + b"\x00" * abs(value)
    edited = [msgpack.packb(env, use_bin_type=True), data_frame]
    try:
        got = codec.decode(edited)
    except ProtocolError:
        return
    # accepted: every array views the data frame, inside it, none overlapping another
    spans = []
    base = np.frombuffer(edited[1], np.uint8)
    lo = base.__array_interface__["data"][0]
    for ep in got.episodes:
        for a in (ep.token_ids, ep.loss_mask, ep.logprobs, ep.versions):
            if a.nbytes:
                start = a.__array_interface__["data"][0] - lo if np.shares_memory(a, base) else None
                assert start is not None and 0 <= start and start + a.nbytes <= len(edited[1])
                spans.append((start, start + a.nbytes))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
