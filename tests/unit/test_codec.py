"""The msgpack codec: every record round-trips exactly, big arrays are never copied on
decode, and every strictness rule rejects with a ``ProtocolError`` naming what is wrong."""

from __future__ import annotations

import re
from typing import Any, Callable

import msgpack
import numpy as np
import pytest
import zmq

from turnscale.protocol import codec
from turnscale.protocol import messages as m
from turnscale.protocol.errors import ProtocolError
from tests.unit.message_examples import all_examples, assert_same, episode, examples, group

ALL = all_examples()


def _ids(x: Any) -> str:
    return type(x).__name__


def unpack(frame0: Any) -> dict:
    """Frame 0 as plain data, array exts kept opaque (to edit and re-pack)."""
    return msgpack.unpackb(bytes(frame0), raw=False, ext_hook=lambda c, d: msgpack.ExtType(c, d))


def pack(env: Any) -> bytes:
    return msgpack.packb(env, use_bin_type=True)


def env(t: str, body: Any, v: Any = m.SCHEMA_VERSION) -> bytes:
    return pack({"v": v, "t": t, "b": body})


def inline(dtype: str, shape: list, data: bytes) -> msgpack.ExtType:
    return msgpack.ExtType(codec.ARRAY_INLINE, pack([dtype, shape, data]))


def oob(dtype: str, shape: list, idx: Any, offset: Any = 0) -> msgpack.ExtType:
    return msgpack.ExtType(codec.ARRAY_FRAME, pack([dtype, shape, idx, offset]))


def chunk_body(data: Any, **over: Any) -> dict:
    return {"version": 1, "index": 0, "checksum": 0, "data": data, **over}


# ----------------------------------------------------------------------------- round trips


def test_examples_cover_every_registered_record():
    assert set(examples()) == set(m.REGISTRY)


@pytest.mark.parametrize("msg", ALL, ids=_ids)
@pytest.mark.parametrize("path", ["inline", "out_of_band"])
def test_every_record_round_trips_field_by_field(msg, path):
    threshold = 1 << 40 if path == "inline" else 0
    frames = codec.encode(msg, out_of_band_bytes=threshold)
    n_arrays = _count_arrays(msg)
    assert len(frames) == 1 + (min(n_arrays, 1) if path == "out_of_band" else 0)  # all packed into one data frame
    got = codec.decode(frames)
    assert_same(msg, got)
    if not any(isinstance(v, np.ndarray) for v in _walk(msg)):
        assert got == msg


def _walk(x: Any):
    import dataclasses

    if dataclasses.is_dataclass(x):
        for f in dataclasses.fields(x):
            yield from _walk(getattr(x, f.name))
    elif isinstance(x, list):
        for v in x:
            yield from _walk(v)
    else:
        yield x


def _count_arrays(msg: Any) -> int:
    return sum(isinstance(v, np.ndarray) for v in _walk(msg))


def test_round_trip_through_bytes_copies_of_frames():
    msg = group(3, 50_000)  # arrays above the default out-of-band threshold
    frames = [bytes(f) for f in codec.encode(msg)]
    assert len(frames) > 1
    assert_same(msg, codec.decode(frames))


def test_default_threshold_sends_big_arrays_out_of_band_and_small_ones_inline():
    small, big = episode(100), episode(8000)
    assert len(codec.encode(small)) == 1
    assert len(codec.encode(big)) == 1 + 1  # three 32 KB arrays packed into one frame, the 8 KB mask inline
    huge = episode(codec.OWN_FRAME_BYTES // 2)  # token ids, log-probs, versions get frames of their own; the mask is packed
    frames = codec.encode(huge)
    assert len(frames) == 1 + 3 + 1
    # own frames are views of the records' arrays: no copy on encode
    assert np.shares_memory(np.frombuffer(frames[1], np.uint8), huge.token_ids)
    assert_same(huge, codec.decode(frames))


def test_packed_arrays_share_one_data_frame_aligned_and_decode_as_views_of_it():
    msg = group(3, 2000)  # 12 arrays of 2-8 KB
    frames = codec.encode(msg, out_of_band_bytes=0)
    assert len(frames) == 2
    got = codec.decode([frames[0], bytes(frames[1])])
    assert_same(msg, got)
    data = np.frombuffer(bytes(frames[1]), np.uint8)
    got = codec.decode([frames[0], data])
    for ep in got.episodes:
        for name in ("token_ids", "loss_mask", "logprobs", "versions"):
            arr = getattr(ep, name)
            assert np.shares_memory(arr, data), name
            assert arr.__array_interface__["data"][0] % 8 == 0 or arr.nbytes == 0


def test_a_message_of_schema_4_is_refused_with_a_clear_error():
    """Schema 4 sent one frame per out-of-band array (ext ``[dtype, shape, frame]``)."""
    old = [env("WeightChunk", chunk_body(msgpack.ExtType(codec.ARRAY_FRAME, pack(["|u1", [4], 1]))), v=4), b"\x00" * 4]
    with pytest.raises(ProtocolError, match=rf"schema version 4 != {m.SCHEMA_VERSION}; upgrade the older side"):
        codec.decode(old)


def test_non_contiguous_and_zero_d_arrays_round_trip():
    base = np.arange(200, dtype=np.uint8)
    msg = m.WeightChunk(version=1, index=0, checksum=0, data=base[::2])
    for threshold in (0, 1 << 40):
        got = codec.decode(codec.encode(msg, out_of_band_bytes=threshold))
        assert np.array_equal(got.data, base[::2])


SIXTY_FOUR_MB = 64 << 20


def _big_group() -> m.TrajectoryGroup:
    n = SIXTY_FOUR_MB // 4  # int32 token ids: 64 MB
    ids = np.arange(n, dtype=np.int32)
    mask = np.zeros(n, np.uint8)
    mask[n // 2 :] = 1
    ep = m.Episode(token_ids=ids, loss_mask=mask, logprobs=np.full(n, -0.5, np.float32), versions=np.full(n, 2, np.int32),
                   prompt_len=n // 2, turns=[], finish_reason="turn_limit", reward=0.0, success=False, turn_limit=3)
    return m.TrajectoryGroup(lease_id="l", actor_id="a", task=m.Task(env="babyai", data_idx=0), turn_limit=3, episodes=[ep])


def test_64mb_arrays_decode_as_views_of_the_received_buffers():
    msg = _big_group()
    frames = codec.encode(msg)
    got = codec.decode(frames)
    src, dst = msg.episodes[0], got.episodes[0]
    for name in ("token_ids", "loss_mask", "logprobs", "versions"):
        assert_same(getattr(src, name), getattr(dst, name))
        # decoded straight over the frame, which itself is a view of the sent array (over OWN_FRAME_BYTES)
        assert np.shares_memory(getattr(dst, name), getattr(src, name)), name
    assert dst.token_ids.nbytes >= SIXTY_FOUR_MB
    chunk = m.WeightChunk(version=1, index=0, checksum=0, data=np.ones(SIXTY_FOUR_MB, np.uint8))
    frames = codec.encode(chunk)
    got_chunk = codec.decode(frames)
    assert np.shares_memory(got_chunk.data, chunk.data)


def test_64mb_array_decodes_over_the_received_zmq_frame_without_a_copy():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://big")
        b.connect("inproc://big")
        msg = _big_group()
        a.send_multipart(codec.encode(msg), copy=False)
        assert b.poll(10_000)
        frames = b.recv_multipart(copy=False)
        got = codec.decode(frames)
        ids = got.episodes[0].token_ids
        assert ids.nbytes >= SIXTY_FOUR_MB
        frame_views = [np.frombuffer(f.buffer, np.uint8) for f in frames[1:]]
        assert any(np.shares_memory(ids, v) for v in frame_views)
        assert_same(msg.episodes[0].token_ids, ids)
        assert_same(msg.episodes[0].logprobs, got.episodes[0].logprobs)
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


# ----------------------------------------------------------------------------- expect


def test_expect_rejects_a_reply_of_another_type():
    frames = codec.encode(m.GroupAck(lease_id="x", accepted=True))
    with pytest.raises(ProtocolError, match="got GroupAck, expected LeaseGrant"):
        codec.decode(frames, expect=m.LeaseGrant)
    with pytest.raises(ProtocolError, match="expected LeaseGrant or Welcome"):
        codec.decode(frames, expect=(m.LeaseGrant, m.Welcome))
    assert codec.decode(frames, expect=(m.LeaseGrant, m.GroupAck)).accepted


# ----------------------------------------------------------------------------- strictness

GOOD_CHUNK = codec.encode(m.WeightChunk(version=1, index=0, checksum=0, data=np.zeros(32, np.uint8)), out_of_band_bytes=0)


def _edit(msg: Any, fn: Callable[[dict], None], *, threshold: int = 1 << 40) -> list:
    frames = list(codec.encode(msg, out_of_band_bytes=threshold))
    e = unpack(frames[0])
    fn(e)
    frames[0] = pack(e)
    return frames


def _set(path: str, value: Any) -> Callable[[dict], None]:
    """Setter for a dotted path inside the body (``episodes.0.loss_mask``)."""

    def fn(e: dict) -> None:
        node: Any = e["b"]
        parts = path.split(".")
        for p in parts[:-1]:
            node = node[int(p)] if isinstance(node, list) else node[p]
        last = parts[-1]
        if value is _DELETE:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return fn


_DELETE = object()

STRICT_CASES: list[tuple[str, Callable[[], list], str]] = [
    ("not msgpack", lambda: [b"\xc1\xc1\xc1"], r"not valid msgpack"),
    ("truncated msgpack", lambda: [codec.encode(m.Shutdown(reason="x"))[0][:-2]], r"not valid msgpack"),
    ("trailing bytes", lambda: [codec.encode(m.Shutdown(reason="x"))[0] + b"\x00"], r"not valid msgpack"),
    ("no frames", lambda: [], r"no frames"),
    ("envelope not a map", lambda: [pack([1, "Shutdown", {}])], r"envelope"),
    ("envelope extra key", lambda: [pack({"v": 1, "t": "Shutdown", "b": {"reason": "x"}, "x": 1})], r"envelope"),
    ("wrong schema version", lambda: [env("Shutdown", {"reason": "x"}, v=m.SCHEMA_VERSION + 1)], rf"schema version {m.SCHEMA_VERSION + 1} != {m.SCHEMA_VERSION}"),
    ("schema version as bool", lambda: [env("Shutdown", {"reason": "x"}, v=True)], r"schema version"),
    ("unknown type", lambda: [env("Pickle", {})], r"unknown message type 'Pickle'"),
    ("type not a string", lambda: [env(7, {})], r"unknown message type 7"),  # type: ignore[arg-type]
    ("body not a map", lambda: [env("Shutdown", ["x"])], r"Shutdown: expected a map"),
    ("unknown field", lambda: [env("Shutdown", {"reason": "x", "extra": 1})], r"Shutdown: unknown field\(s\) \['extra'\]"),
    ("missing field", lambda: [env("GroupAck", {"accepted": True})], r"GroupAck\.lease_id: missing required field"),
    ("wrong type str", lambda: [env("Shutdown", {"reason": 5})], r"Shutdown\.reason: expected str, got int"),
    ("wrong type int", lambda: [env("WeightChunkRequest", {"version": "1", "index": 0})], r"WeightChunkRequest\.version: expected int, got str"),
    ("bool is not int", lambda: [env("WeightChunkRequest", {"version": True, "index": 0})], r"WeightChunkRequest\.version: expected int, got bool"),
    ("wrong type bool", lambda: [env("GroupAck", {"lease_id": "x", "accepted": 1})], r"GroupAck\.accepted: expected bool, got int"),
    ("wrong type float", lambda: [env("LeaseGrant", {"leases": [], "retry_after_s": "1"})], r"LeaseGrant\.retry_after_s: expected float"),
    ("list expected", lambda: [env("LeaseGrant", {"leases": {}, "retry_after_s": 1.0})], r"LeaseGrant\.leases: expected a list"),
    ("list item wrong", lambda: [env("HeartbeatAck", {"unknown_lease_ids": ["a", 3]})], r"HeartbeatAck\.unknown_lease_ids\[1\]: expected str"),
    ("dict value wrong", lambda: [env("Heartbeat", {"actor_id": "a", "lease_ids": [], "policy_version": 1, "stats": {"x": "y"}})], r"Heartbeat\.stats\['x'\]: expected float"),
    ("null not allowed", lambda: [env("Shutdown", {"reason": None})], r"Shutdown\.reason"),
    ("nested record missing field", lambda: _edit(examples()["Lease"], _set("task", {"env": "x"})), r"Lease\.task\.data_idx: missing required field"),
    ("nested record unknown field", lambda: _edit(examples()["Lease"], _set("task.bogus", 1)), r"Lease\.task: unknown field"),
    ("optional record wrong", lambda: _edit(examples()["PolicyAnnouncement"], _set("manifest", 3)), r"PolicyAnnouncement\.manifest: expected a map"),
    ("array expected", lambda: [env("WeightChunk", chunk_body(b"\x00" * 4))], r"WeightChunk\.data: expected an array, got bytes"),
    ("array where int expected", lambda: [env("WeightChunkRequest", {"version": inline("|u1", [1], b"\x00"), "index": 0})], r"WeightChunkRequest\.version: expected int, got an array"),
    ("wrong dtype", lambda: [env("WeightChunk", chunk_body(inline("<i4", [1], b"\x00" * 4)))], r"WeightChunk\.data: dtype int32, expected uint8"),
    ("dtype not allowed", lambda: [env("WeightChunk", chunk_body(inline("|O", [1], b"\x00" * 8)))], r"WeightChunk\.data: dtype '\|O' is not allowed"),
    ("big-endian dtype", lambda: [env("WeightChunk", chunk_body(inline(">i4", [1], b"\x00" * 4)))], r"WeightChunk\.data: dtype '>i4' is not allowed"),
    ("unknown dtype", lambda: [env("WeightChunk", chunk_body(inline("nonsense", [1], b"\x00")))], r"WeightChunk\.data: unknown dtype 'nonsense'"),
    ("wrong ndim", lambda: [env("WeightChunk", chunk_body(inline("|u1", [2, 2], b"\x00" * 4)))], r"WeightChunk\.data: 2-d array, expected 1-d"),
    ("negative shape", lambda: [env("WeightChunk", chunk_body(inline("|u1", [-1], b"")))], r"WeightChunk\.data: bad array shape"),
    ("shape not ints", lambda: [env("WeightChunk", chunk_body(inline("|u1", ["4"], b"\x00" * 4)))], r"WeightChunk\.data: bad array shape"),
    ("inline length mismatch", lambda: [env("WeightChunk", chunk_body(inline("|u1", [5], b"\x00" * 4)))], r"WeightChunk\.data: array data is 4 bytes.*needs 5"),
    ("inline data not bytes", lambda: [env("WeightChunk", chunk_body(inline("|u1", [1], [0])))], r"WeightChunk\.data: inline array data must be bytes"),
    ("array ext malformed", lambda: [env("WeightChunk", chunk_body(msgpack.ExtType(codec.ARRAY_INLINE, pack(["|u1", [1]]))))], r"array ext must be \[dtype, shape, data\]"),
    ("schema 4 array ext", lambda: [env("WeightChunk", chunk_body(msgpack.ExtType(codec.ARRAY_FRAME, pack(["|u1", [1], 1])))), b"\x00"],
     r"array ext must be \[dtype, shape, frame, offset\]"),
    ("frame length mismatch", lambda: [env("WeightChunk", chunk_body(oob("|u1", [10], 1))), b"\x00" * 9], r"WeightChunk\.data: array data is 9 bytes.*needs 10"),
    ("array past the frame's end", lambda: [env("WeightChunk", chunk_body(oob("|u1", [8], 1, 4))), b"\x00" * 10], r"WeightChunk\.data: array data is 6 bytes.*needs 8 \(frame 1, offset 4\)"),
    ("negative offset", lambda: [env("WeightChunk", chunk_body(oob("|u1", [2], 1, -1))), b"\x00" * 10], r"WeightChunk\.data: array offset -1"),
    ("offset not an int", lambda: [env("WeightChunk", chunk_body(oob("|u1", [2], 1, "0"))), b"\x00" * 10], r"WeightChunk\.data: array offset '0'"),
    ("misaligned offset", lambda: _edit(examples()["Episode"], _set("logprobs", oob("<f4", [40], 1, 2)), threshold=0),
     r"Episode\.logprobs: array offset 2 in frame 1 must be a non-negative multiple of 4"),
    ("frame missing", lambda: [env("WeightChunk", chunk_body(oob("|u1", [10], 1)))], r"WeightChunk\.data: array refers to frame 1, which is missing"),
    ("frame index zero", lambda: [env("WeightChunk", chunk_body(oob("|u1", [1], 0))), b"\x00"], r"WeightChunk\.data: array refers to frame 0"),
    ("frame unreferenced", lambda: [*GOOD_CHUNK, b"extra"], r"WeightChunk: frame\(s\) \[2\] not referenced"),
    ("arrays overlap", lambda: _edit(examples()["Episode"], _set("versions", oob("<i4", [40], 1)), threshold=0),
     r"Episode: an array overlaps another one in frame 1"),
    ("loss_mask longer than token_ids", lambda: _edit(examples()["Episode"], _set("loss_mask", inline("|u1", [41], b"\x00" * 41))),
     r"Episode\.loss_mask: length 41 != token_ids length 40"),
    ("loss_mask longer, nested in group", lambda: _edit(group(), _set("episodes.1.loss_mask", inline("|u1", [41], b"\x00" * 41))),
     r"TrajectoryGroup\.episodes\[1\]: Episode\.loss_mask: length 41 != token_ids length 40"),
    ("loss_mask not 0/1", lambda: _edit(examples()["Episode"], _set("loss_mask", inline("|u1", [40], b"\x02" * 40))), r"Episode\.loss_mask: values must be 0 or 1"),
    ("bad finish reason", lambda: _edit(examples()["Episode"], _set("finish_reason", "exploded")), r"Episode\.finish_reason"),
    ("turn outside stream", lambda: _edit(examples()["Episode"], _set("turns.0.token_end", 999)), r"Episode\.turns\[0\]: token range"),
    ("group mixes turn limits", lambda: _edit(group(), _set("episodes.0.turn_limit", 9)), r"TrajectoryGroup\.episodes\[0\]\.turn_limit"),
    ("untrainable group not failed", lambda: _edit(group(), _set("episodes.0.finish_reason", "env_error")), r"TrajectoryGroup\.failed"),
    ("sampling check", lambda: _edit(examples()["SamplingParams"], _set("temperature", 0.0)), r"SamplingParams\.temperature: must be > 0"),
    ("manifest check", lambda: _edit(examples()["WeightManifest"], _set("total_bytes", 301)), r"WeightManifest: chunks cover 300 bytes"),
    ("manifest tensor nbytes vs shape", lambda: _edit(examples()["WeightManifest"], _set("tensors.1.nbytes", 90)),
     r"WeightManifest\.tensors: b: shape \[50\] x bfloat16 is 100 bytes, nbytes says 90"),
    ("manifest chunk index vs position", lambda: _edit(examples()["WeightManifest"], _set("chunks.1.index", 5)),
     r"WeightManifest\.chunks: chunk at position 1 says index 5"),
    ("manifest unknown tensor dtype", lambda: _edit(examples()["WeightManifest"], _set("tensors.0.dtype", "complex64")),
     r"WeightManifest\.tensors: w: unknown dtype 'complex64'"),
    ("unknown ext type", lambda: [env("Shutdown", {"reason": msgpack.ExtType(42, b"x")})], r"unknown msgpack ext type 42"),
    ("deep nesting", lambda: [b"\x91" * 100_000 + b"\xc0"], r"nests too deeply"),
    ("deep nesting in a field", lambda: [env("Heartbeat", {"actor_id": "a", "lease_ids": [[[[["x"]]]]], "policy_version": 1})], r"Heartbeat\.lease_ids\[0\]: expected str"),
    ("map key not a string", lambda: [env("Shutdown", {1: "x"})], r"Shutdown: unknown field\(s\) \[1\]"),
]


@pytest.mark.parametrize("case,make,pattern", STRICT_CASES, ids=[c[0] for c in STRICT_CASES])
def test_strict_decoding_names_what_is_wrong(case, make, pattern):
    frames = make()
    with pytest.raises(ProtocolError) as info:
        codec.decode(frames)
    assert re.search(pattern, str(info.value)), f"{case}: {info.value}"


def test_the_unmodified_cases_decode():
    """The strictness cases edit valid messages; the originals must decode (so each case
    fails for the reason it names, not for another)."""
    for msg in (examples()["Lease"], examples()["Episode"], group(), examples()["PolicyAnnouncement"], examples()["WeightManifest"]):
        codec.decode(_edit(msg, lambda e: None))
        codec.decode(_edit(msg, lambda e: None, threshold=0))
    codec.decode(GOOD_CHUNK)
    codec.decode([env("WeightChunk", chunk_body(oob("|u1", [10], 1))), b"\x00" * 10])
    codec.decode([env("WeightChunk", chunk_body(inline("|u1", [4], b"\x00" * 4)))])
    codec.decode([env("Heartbeat", {"actor_id": "a", "lease_ids": ["x"], "policy_version": 1, "stats": {"x": 1}})])


# ----------------------------------------------------------------------------- limits


def test_message_over_max_message_bytes_is_rejected():
    frames = codec.encode(m.WeightChunk(version=1, index=0, checksum=0, data=np.zeros(4096, np.uint8)))
    with pytest.raises(ProtocolError, match=r"message is \d+ bytes, over the limit of 1000"):
        codec.decode(frames, codec.Limits(max_message_bytes=1000))


def test_header_over_max_header_bytes_is_rejected():
    frames = codec.encode(m.Shutdown(reason="x" * 500))
    with pytest.raises(ProtocolError, match=r"header frame is \d+ bytes, over 100"):
        codec.decode(frames, codec.Limits(max_header_bytes=100))


@pytest.mark.parametrize("threshold", [0, 1 << 40], ids=["out_of_band", "inline"])
def test_array_over_max_array_bytes_is_rejected_naming_the_field(threshold):
    frames = codec.encode(group(1, 400), out_of_band_bytes=threshold)
    with pytest.raises(ProtocolError, match=r"TrajectoryGroup\.episodes\[0\]\.token_ids: array of shape \[400\] \(1600 bytes\) is over the limit of 1000"):
        codec.decode(frames, codec.Limits(max_array_bytes=1000))


def test_array_shape_claiming_huge_size_is_rejected_before_allocation():
    for shape in ([2**62, 2**62], [0, 2**40]):
        with pytest.raises(ProtocolError, match=r"WeightChunk\.data: array of shape"):
            codec.decode([env("WeightChunk", chunk_body(inline("|u1", shape, b"")))])


def test_list_over_max_items_is_rejected():
    msg = m.HeartbeatAck(unknown_lease_ids=["x"] * 20)
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        codec.decode(codec.encode(msg), codec.Limits(max_items=10))
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        codec.decode(codec.encode(m.Shutdown(reason="y" * 20)), codec.Limits(max_items=10))


# ----------------------------------------------------------------------------- encode side


def test_encode_refuses_what_is_not_a_record():
    with pytest.raises(ProtocolError, match="not a protocol.messages record"):
        codec.encode({"t": "Shutdown"})


def test_encode_refuses_arrays_of_dtypes_not_allowed_on_the_wire():
    for arr in (np.array([object()] * 3, dtype=object), np.zeros(3, np.complex64), np.zeros(3, ">i4")):
        with pytest.raises(ProtocolError, match="not allowed on the wire"):
            codec.encode(m.WeightChunk(version=1, index=0, checksum=0, data=arr))


def test_encode_refuses_values_msgpack_cannot_hold():
    with pytest.raises(ProtocolError, match="cannot encode"):
        codec.encode(m.WeightChunkRequest(version=2**70, index=0))
    with pytest.raises(ProtocolError, match="cannot encode value of type set"):
        codec.encode(m.Shutdown(reason={1, 2}))  # type: ignore[arg-type]


def test_no_pickle_in_the_codec():
    import inspect

    import turnscale.protocol.codec as c
    import turnscale.protocol.transport as t

    for mod in (c, t, m):
        src = inspect.getsource(mod)
        assert "import pickle" not in src and "recv_pyobj" not in src and "send_pyobj" not in src


def test_error_messages_quote_values_briefly():
    huge = "x" * 100_000
    for frames in ([env(huge, {})], [env("Shutdown", {"reason": "r"}, v=huge)], [env("Shutdown", {huge: 1})]):
        with pytest.raises(ProtocolError) as info:
            codec.decode(frames)
        assert len(str(info.value)) < 300


def test_frames_given_as_typed_memoryviews_are_counted_in_bytes():
    f32 = np.arange(10, dtype=np.float32)
    header = codec.encode(m.WeightChunk(version=1, index=0, checksum=0, data=f32.view(np.uint8)), out_of_band_bytes=0)[0]
    got = codec.decode([header, memoryview(f32)])
    assert np.array_equal(got.data, f32.view(np.uint8)) and np.shares_memory(got.data, f32)


def test_a_hello_from_schema_6_is_rejected_naming_both_versions():
    """Schema 7 added ``Hello.pool``: an actor of the previous release is refused with a
    ``ProtocolError`` telling which side to upgrade, not half-understood."""
    body = {"actor_id": "a", "host": "h", "pid": 1, "engine": "hf", "device": "cpu", "max_groups": 1, "schema_version": 6}
    with pytest.raises(ProtocolError, match=rf"schema version 6 != {m.SCHEMA_VERSION}; upgrade the older side"):
        codec.decode([env("Hello", body, v=6)])


# ----------------------------------------------------------------------------- frame count and error size


def test_decode_refuses_a_message_over_max_frames_before_reading_any_frame():
    many = [*GOOD_CHUNK, *([b""] * 300_000)]
    with pytest.raises(ProtocolError, match=r"message has 300002 frames, over the limit of 1024$"):
        codec.decode(many)
    assert codec.decode(GOOD_CHUNK, codec.Limits(max_frames=2)).index == codec.decode(GOOD_CHUNK).index
    with pytest.raises(ProtocolError, match="over the limit of 1"):
        codec.decode(GOOD_CHUNK, codec.Limits(max_frames=1))


def test_unreferenced_frames_error_lists_a_few_and_the_count():
    """The error text is sent to the peer and logged: it must not grow with the message."""
    many = [*GOOD_CHUNK, *([b""] * 1000)]
    with pytest.raises(ProtocolError) as info:
        codec.decode(many, codec.Limits(max_frames=2000))
    text = str(info.value)
    assert re.search(r"frame\(s\) \[2, 3, 4, 5, 6, 7, 8, 9, \.\.\. \(1000 in all\)\] not referenced", text), text
    assert len(text) < 200


def test_a_legal_group_uses_few_frames_with_or_without_an_arena():
    """``Limits.max_frames`` (1024) leaves room: a group's arrays travel in a few frames."""
    from turnscale.protocol.arena import Arena
    from dataclasses import replace

    g = group()
    big = [replace(ep, token_ids=np.zeros(40_000, np.int32), loss_mask=np.zeros(40_000, np.uint8),
                   logprobs=np.zeros(40_000, np.float32), versions=np.zeros(40_000, np.int32), turns=[])
           for ep in g.episodes]
    plain = codec.encode(replace(g, episodes=big * 8))
    assert len(plain) <= 4 * len(big) * 8 + 2 < codec.DEFAULT_LIMITS.max_frames
    arena = Arena()
    carved = [replace(ep, **{k: arena.array(getattr(ep, k), getattr(ep, k).dtype)
                             for k in ("token_ids", "loss_mask", "logprobs", "versions")}) for ep in big * 8]
    assert len(codec.encode(replace(g, episodes=carved))) <= 8


def test_clip_bounds_error_text_and_says_what_was_cut():
    from turnscale.protocol.errors import MAX_ERROR_CHARS, clip

    assert clip("short") == "short"
    cut = clip("x" * 2_300_000)
    assert len(cut) == MAX_ERROR_CHARS and cut.endswith("... [2299700 more characters]")
