"""Fuzzing the decoder with a seeded RNG: malformed payloads raise ``ProtocolError`` and
nothing else, and the whole run is bounded in time (pytest-timeout below).

Every payload in the ``must_fail`` families is invalid by construction (a strict prefix
of a msgpack object never parses; a type swap never matches the field's annotation; an
array above ``max_array_bytes`` is over the limit).  Bit flips may land in bytes that
keep the message valid (array data, string characters), so for them the rule is weaker:
``ProtocolError`` or a record that re-encodes and decodes to itself.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

import msgpack
import numpy as np
import pytest

from turnscale.protocol import codec
from turnscale.protocol import messages as m
from turnscale.protocol.errors import ProtocolError
from tests.unit.message_examples import all_examples, assert_same, episode

SEED = 20251129
MIN_MUST_FAIL = 10_000

pytestmark = pytest.mark.timeout(60)


def _encodings() -> list[tuple[str, list[bytes]]]:
    """Every example, encoded with arrays inline and with arrays out-of-band."""
    out = []
    for msg in all_examples():
        for threshold in (1 << 40, 0):
            out.append((type(msg).__name__, [bytes(f) for f in codec.encode(msg, out_of_band_bytes=threshold)]))
    return out


ENCODED = _encodings()


def _decode_must_fail(frames: list[Any], limits: codec.Limits = codec.DEFAULT_LIMITS) -> None:
    try:
        got = codec.decode(frames, limits)
    except ProtocolError:
        return
    except BaseException as exc:  # noqa: BLE001 - the point of the test
        raise AssertionError(f"{type(exc).__name__} escaped decode for {_show(frames)}: {exc}") from exc
    raise AssertionError(f"malformed payload decoded to {type(got).__name__}: {_show(frames)}")


def _show(frames: list[Any]) -> str:
    return repr([bytes(f)[:80] for f in frames])


# ----------------------------------------------------------------------------- generators


def random_bytes(rng: np.random.Generator, n: int) -> Iterator[list[bytes]]:
    prefixes = [b"", b"\x83", b"\x83\xa1v\x01", b"\x83\xa1v\x01\xa1t", b"\xc7", b"\xd8\x02", b"\xdf\xff\xff\xff\xff"]
    for i in range(n):
        body = rng.bytes(int(rng.integers(0, 600)))
        frames = [prefixes[i % len(prefixes)] + body]
        if i % 5 == 0:
            frames.append(rng.bytes(int(rng.integers(0, 64))))
        yield frames


def truncations(rng: np.random.Generator, per_message: int) -> Iterator[list[bytes]]:
    for _, frames in ENCODED:
        head = frames[0]
        for cut in rng.integers(0, len(head), per_message):
            yield [head[:cut], *frames[1:]]
        for k in range(1, len(frames)):  # shorten or drop one array frame
            if len(frames[k]):
                cut = int(rng.integers(0, len(frames[k])))
                yield [*frames[:k], frames[k][:cut], *frames[k + 1 :]]
            yield frames[:k] + frames[k + 1 :]
        if len(frames) > 1:
            yield [*frames, frames[1]]  # an extra, unreferenced frame


_SWAPS: list[Any] = ["s", 12345, 1.5, True, [1], {"k": 1}, b"raw", msgpack.ExtType(codec.ARRAY_INLINE, msgpack.packb(["|u1", [1], b"\x00"]))]


def _compatible(orig: Any, rep: Any) -> bool:
    """Whether ``rep`` might be valid where ``orig`` was (such swaps are skipped)."""
    if orig is None:
        return True
    if isinstance(orig, float) and isinstance(rep, int) and not isinstance(rep, bool):
        return True
    return type(orig) is type(rep)


def _paths(node: Any, path: tuple = ()) -> Iterator[tuple]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield (*path, k)
            yield from _paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node[:3]):
            yield (*path, i)
            yield from _paths(v, (*path, i))


def _get(node: Any, path: tuple) -> Any:
    for p in path:
        node = node[p]
    return node


def type_swaps() -> Iterator[list[bytes]]:
    for _, frames in ENCODED:
        env = msgpack.unpackb(frames[0], raw=False, ext_hook=lambda c, d: msgpack.ExtType(c, d))
        for path in _paths(env["b"]):
            orig = _get(env["b"], path)
            if isinstance(env["b"], dict) and isinstance(_get(env["b"], path[:-1]), dict) and path[-1] == "stats":
                continue  # dict[str, float]: a map of str -> number is valid
            for rep in _SWAPS:
                if _compatible(orig, rep):
                    continue
                e = copy.deepcopy(env)
                _get(e["b"], path[:-1])[path[-1]] = rep
                yield [msgpack.packb(e, use_bin_type=True), *frames[1:]]
        for key, bad in (("v", m.SCHEMA_VERSION + 1), ("v", "1"), ("t", "Nope"), ("t", 1), ("b", [])):
            e = copy.deepcopy(env)
            e[key] = bad
            yield [msgpack.packb(e, use_bin_type=True), *frames[1:]]


def oversize_arrays(rng: np.random.Generator, n: int) -> Iterator[tuple[list[bytes], codec.Limits]]:
    for i in range(n):
        size = int(rng.integers(65, 5000))
        limit = int(rng.integers(0, 64))
        if i % 2:
            msg: Any = m.WeightChunk(version=1, index=0, checksum=0, data=rng.integers(0, 255, size, dtype=np.uint8))
        else:
            ep = episode(size // 4 + 20, seed=i)
            msg = m.TrajectoryGroup(lease_id="l", actor_id="a", task=m.Task(env="e", data_idx=0), turn_limit=5, episodes=[ep])
        threshold = 0 if i % 3 else 1 << 40
        yield [bytes(f) for f in codec.encode(msg, out_of_band_bytes=threshold)], codec.Limits(max_array_bytes=limit)


def bit_flips(rng: np.random.Generator, n: int) -> Iterator[list[bytes]]:
    for i in range(n):
        _, frames = ENCODED[i % len(ENCODED)]
        k = 0 if len(frames) == 1 or i % 4 else int(rng.integers(0, len(frames)))
        buf = bytearray(frames[k])
        if not buf:
            continue
        for _ in range(int(rng.integers(1, 4))):
            pos = int(rng.integers(0, len(buf)))
            buf[pos] ^= 1 << int(rng.integers(0, 8))
        yield [*frames[:k], bytes(buf), *frames[k + 1 :]]


# ----------------------------------------------------------------------------- tests


def test_ten_thousand_malformed_payloads_each_raise_protocol_error():
    rng = np.random.default_rng(SEED)
    counts = {"random": 0, "truncated": 0, "type_swapped": 0, "oversize": 0}
    for frames in random_bytes(rng, 4000):
        _decode_must_fail(frames)
        counts["random"] += 1
    for frames in truncations(rng, 60):
        _decode_must_fail(frames)
        counts["truncated"] += 1
    for frames in type_swaps():
        _decode_must_fail(frames)
        counts["type_swapped"] += 1
    for frames, limits in oversize_arrays(rng, 600):
        _decode_must_fail(frames, limits)
        counts["oversize"] += 1
    assert sum(counts.values()) >= MIN_MUST_FAIL, counts
    assert min(counts.values()) >= 500, counts


def test_bit_flipped_messages_raise_protocol_error_or_decode_to_a_valid_record():
    rng = np.random.default_rng(SEED + 1)
    rejected = accepted = 0
    for frames in bit_flips(rng, 6000):
        try:
            got = codec.decode(frames)
        except ProtocolError:
            rejected += 1
            continue
        except BaseException as exc:  # noqa: BLE001
            raise AssertionError(f"{type(exc).__name__} escaped decode for {_show(frames)}: {exc}") from exc
        accepted += 1
        assert_same(got, codec.decode(codec.encode(got)))  # what got through is a valid record
    assert rejected + accepted >= 5900
    assert rejected > accepted, (rejected, accepted)


def test_every_valid_encoding_used_by_the_fuzzer_decodes():
    for name, frames in ENCODED:
        assert type(codec.decode(frames)).__name__ == name
