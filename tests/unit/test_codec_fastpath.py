"""The decoder's whole-record fast path (a map holding every field of an all-scalar record,
in field order, each of exactly its annotated type) decodes exactly what the field-by-field
path decodes, and every map it does not match still gets the strict checks."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from turnscale.protocol import codec
from turnscale.protocol import messages as m
from turnscale.protocol.errors import ProtocolError

TURN = m.Turn(index=2, token_start=5, token_end=9, output_text="go <action>n</action>", action="n", parse_error=False,
              observation="a wall", reward=0.5, done=False, policy_version=3, gen_latency_s=0.01, env_latency_s=0.002)


def _frames(t: str, body: dict) -> list[bytes]:
    return [msgpack.packb({"v": m.SCHEMA_VERSION, "t": t, "b": body}, use_bin_type=True)]


def _body(rec) -> dict:
    return {f.name: getattr(rec, f.name) for f in dataclasses.fields(rec)}


def _turn(body: dict) -> list[bytes]:
    """A ``Turn`` body as a whole message (every record is registered, so it decodes at the root)."""
    return _frames("Turn", body)


def test_a_record_in_field_order_decodes_equal_to_the_original():
    assert codec.decode(_turn(_body(TURN))) == TURN


def test_a_record_with_its_keys_in_another_order_decodes_the_same():
    body = dict(reversed(list(_body(TURN).items())))
    assert codec.decode(_turn(body)) == TURN


def test_an_int_in_a_float_field_decodes_as_a_float():
    out = codec.decode(_turn({**_body(TURN), "reward": 1}))
    assert out.reward == 1.0 and type(out.reward) is float


@pytest.mark.parametrize("field, value, pattern", [
    ("index", True, r"Turn\.index: expected int, got bool"),
    ("done", 0, r"Turn\.done: expected bool, got int"),
    ("reward", "1", r"Turn\.reward: expected float, got str"),
    ("action", None, r"Turn\.action: expected str, got NoneType"),
])
def test_a_value_of_the_wrong_type_is_refused_naming_the_field(field, value, pattern):
    with pytest.raises(ProtocolError, match=pattern):
        codec.decode(_turn({**_body(TURN), field: value}))


def test_an_extra_key_after_every_field_is_refused():
    with pytest.raises(ProtocolError, match=r"unknown field\(s\) \['extra'\]"):
        codec.decode(_turn({**_body(TURN), "extra": 1}))


def test_a_missing_field_is_refused_and_a_missing_default_is_filled_in():
    body = _body(TURN)
    del body["observation"]
    with pytest.raises(ProtocolError, match=r"Turn\.observation: missing required field"):
        codec.decode(_turn(body))
    task = codec.decode(_frames("Task", {"env": "babyai", "data_idx": 4}))
    assert task == m.Task(env="babyai", data_idx=4, split="train", task_id="")


def test_a_scalar_record_with_a_check_is_still_checked_on_the_fast_path():
    body = _body(m.SamplingParams())
    assert codec.decode(_frames("SamplingParams", body)) == m.SamplingParams()
    with pytest.raises(ProtocolError, match=r"SamplingParams\.temperature: must be > 0"):
        codec.decode(_frames("SamplingParams", {**body, "temperature": 0.0}))


# ----------------------------------------------------------------------------- frame 0 parsers
# A frame 0 of at most ``Limits.max_items`` bytes is parsed by msgspec (it cannot hold a
# list, map or string over the limit); a larger one by msgpack-python with every limit.


def test_small_and_large_header_parsers_decode_every_example_to_the_same_record():
    from tests.unit.message_examples import all_examples, assert_same

    for msg in all_examples():
        for threshold in (1 << 40, 0):
            frames = [bytes(f) for f in codec.encode(msg, out_of_band_bytes=threshold)]
            small = codec.decode(frames)  # default max_items (1 Mi) > any example's frame 0
            large = codec.decode(frames, codec.Limits(max_items=len(frames[0]) - 1))
            assert_same(small, msg)
            assert_same(large, msg)


def test_a_non_string_map_key_is_refused_by_both_header_parsers():
    frames = _frames("Shutdown", {1: "x"})
    with pytest.raises(ProtocolError, match=r"Shutdown: unknown field\(s\) \[1\]"):
        codec.decode(frames)
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        codec.decode(frames, codec.Limits(max_items=len(frames[0]) - 1))
    stats = _frames("Heartbeat", {"actor_id": "a", "lease_ids": [], "policy_version": 1, "stats": {7: 1.0}})
    with pytest.raises(ProtocolError, match=r"Heartbeat\.stats\.<key>: expected str, got int"):
        codec.decode(stats)


@pytest.mark.parametrize("payload", [b"\xc1\xc1", b"\x93\x01", b"\x91" * 100_000 + b"\xc0", b"\x81\xa1v"])
def test_malformed_small_headers_raise_protocol_error_only(payload):
    with pytest.raises(ProtocolError):
        codec.decode([payload])


def test_a_header_exactly_max_items_bytes_long_is_parsed_within_the_limits():
    frames = _frames("Shutdown", {"reason": "y" * 20})
    limit = len(frames[0])
    assert codec.decode(frames, codec.Limits(max_items=limit)) == m.Shutdown(reason="y" * 20)
    with pytest.raises(ProtocolError, match="not valid msgpack"):  # the string alone is over a limit of 10
        codec.decode(frames, codec.Limits(max_items=10))


def test_array_ext_payloads_are_the_bytes_msgpack_would_write():
    import numpy as np

    for arr in (np.arange(5, dtype=np.int32), np.zeros((3, 300), np.float16), np.zeros(0, np.uint8), np.ones((2, 70000), bool)):
        payload = codec._pack_meta([arr.dtype.str, arr.shape, arr.tobytes()])
        assert payload == msgpack.packb([arr.dtype.str, list(arr.shape), arr.tobytes()], use_bin_type=True)
    for meta in (["<i4", (5,), 1, 0], ["<f4", (2, 3), 300, 70000], ["|u1", (1 << 33,), 2, 1 << 40]):
        assert codec._pack_meta(meta) == msgpack.packb([meta[0], list(meta[1]), *meta[2:]], use_bin_type=True)


# ----------------------------------------------------------------------------- dict-backed records
# ``Turn`` is ``record(slots=False)``: the encoder writes its ``__dict__`` as its map and the
# fast path adopts the decoded map as the new record's ``__dict__``.


def test_a_decoded_dict_backed_record_holds_exactly_its_fields_in_order_and_stays_frozen():
    in_order = codec.decode(_turn(_body(TURN)))
    reordered = codec.decode(_turn(dict(reversed(list(_body(TURN).items())))))
    coerced = codec.decode(_turn({**_body(TURN), "reward": 1}))
    for out in (in_order, reordered, coerced):
        assert list(vars(out)) == [f.name for f in dataclasses.fields(m.Turn)]
        with pytest.raises(dataclasses.FrozenInstanceError):
            out.reward = 2.0  # type: ignore[misc]
    assert in_order == reordered == TURN and hash(in_order) == hash(TURN)
    assert vars(coerced) == {**_body(TURN), "reward": 1.0}


def test_the_encoder_writes_a_dict_backed_record_as_the_map_of_its_fields():
    frame = codec.encode(TURN)[0]
    assert msgpack.unpackb(frame)["b"] == _body(TURN) and list(msgpack.unpackb(frame)["b"]) == list(_body(TURN))
    stray = m.Turn(**_body(TURN))
    object.__setattr__(stray, "extra", 1)  # not a field: never written
    assert codec.encode(stray) == codec.encode(TURN)


def test_a_turn_built_with_an_int_reward_round_trips_as_a_float():
    out = codec.decode(codec.encode(m.Turn(**{**_body(TURN), "reward": 0})))
    assert out.reward == 0.0 and type(out.reward) is float
