"""MessagePack encoding of ``protocol.messages`` records, strict on decode.

Wire format: a list of frames.  Frame 0 is a msgpack map ``{"v": SCHEMA_VERSION,
"t": "<RecordName>", "b": {field: value, ...}}``.  Nested records are maps; numpy
arrays are msgpack ext values: ``ARRAY_INLINE`` carries ``[dtype, shape, bytes]``,
``ARRAY_FRAME`` carries ``[dtype, shape, frame_index]`` and the raw bytes travel as
their own frame (sent with ZeroMQ ``copy=False``; decoded with ``np.frombuffer`` over
the received buffer, so a 64 MB array is never copied on either side).

Decoding checks, in order: total size, msgpack validity, envelope, schema version,
type name, then every field against the record's annotations (exact dtype, ndim,
element count against the frame size, no unknown or missing fields), then the record's
own ``check()``.  Anything wrong raises ``ProtocolError`` naming the field path; no
other exception escapes ``decode``.  No pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

import msgpack
import numpy as np

from protocol.errors import ProtocolError
from protocol.messages import REGISTRY, SCHEMA_VERSION

ARRAY_INLINE = 1
ARRAY_FRAME = 2
OUT_OF_BAND_BYTES = 16 * 1024
"""Arrays at least this large travel as their own frame."""

_ALLOWED_DTYPES = frozenset(
    np.dtype(d) for d in ("uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "float16", "float32", "float64", "bool")
)


@dataclass(frozen=True, slots=True)
class Limits:
    """Decoding limits; anything larger is a ``ProtocolError``.  Sockets also set ZeroMQ's
    ``MAXMSGSIZE`` from ``max_message_bytes`` so oversize messages never reach Python."""

    max_message_bytes: int = 1 << 30
    """Sum of all frames of one message."""
    max_array_bytes: int = 1 << 30
    """One array's bytes."""
    max_header_bytes: int = 64 << 20
    """Frame 0 (the msgpack part)."""
    max_items: int = 1 << 20
    """Elements in one list/map and characters in one string."""


DEFAULT_LIMITS = Limits()

# ----------------------------------------------------------------------------- encode


def encode(msg: Any, *, out_of_band_bytes: int = OUT_OF_BAND_BYTES) -> list[bytes | memoryview]:
    """Encode a registered record into frames (frame 0 msgpack, then raw array frames)."""
    name = type(msg).__name__
    if REGISTRY.get(name) is not type(msg):
        raise ProtocolError(f"cannot encode {type(msg)!r}: not a protocol.messages record")
    frames: list[bytes | memoryview] = [b""]

    def default(obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            if obj.dtype not in _ALLOWED_DTYPES:
                raise ProtocolError(f"cannot encode an array of dtype {obj.dtype} in {name}: not allowed on the wire")
            arr = np.ascontiguousarray(obj)
            meta_dtype = arr.dtype.str
            if arr.nbytes >= out_of_band_bytes:
                frames.append(memoryview(arr.reshape(-1).view(np.uint8)))
                return msgpack.ExtType(ARRAY_FRAME, msgpack.packb([meta_dtype, list(arr.shape), len(frames) - 1]))
            return msgpack.ExtType(ARRAY_INLINE, msgpack.packb([meta_dtype, list(arr.shape), arr.tobytes()]))
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        if isinstance(obj, (np.integer,)):
            return int(obj)
        if isinstance(obj, (np.floating,)):
            return float(obj)
        raise ProtocolError(f"cannot encode value of type {type(obj).__name__} in {name}")

    body = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    try:
        frames[0] = msgpack.packb({"v": SCHEMA_VERSION, "t": name, "b": body}, default=default, use_bin_type=True)
    except ProtocolError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:  # e.g. an int beyond 64 bits
        raise ProtocolError(f"cannot encode {name}: {type(exc).__name__} {exc}") from None
    return frames


# ----------------------------------------------------------------------------- decode


def _buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    if buf is not None:
        return buf if isinstance(buf, memoryview) else memoryview(buf)
    return memoryview(frame)


def decode(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS, *, expect: type | tuple[type, ...] | None = None) -> Any:
    """Decode frames into a record; raise ``ProtocolError`` on anything invalid.

    ``expect`` restricts the accepted record types (a reply of the wrong kind is an error).
    """
    try:
        return _decode(frames, limits, expect)
    except ProtocolError:
        raise
    except RecursionError:
        raise ProtocolError("message nests too deeply") from None
    except Exception as exc:  # a decoder bug must still surface as a typed error
        raise ProtocolError(f"undecodable message ({type(exc).__name__}: {exc})") from None


@dataclass(frozen=True, slots=True)
class _ArrayRef:
    """An array ext as parsed from frame 0; validated (dtype, shape, size, frame) only once
    the field it sits in is known, so every error names the field path."""

    code: int
    dtype: Any
    shape: Any
    data: Any


class _Ctx:
    """Per-message decoding state: the frames, the limits, which frames arrays used."""

    __slots__ = ("bufs", "limits", "used")

    def __init__(self, bufs: list[memoryview], limits: Limits) -> None:
        self.bufs = bufs
        self.limits = limits
        self.used: set[int] = set()


def _ext_hook(code: int, data: bytes) -> Any:
    if code not in (ARRAY_INLINE, ARRAY_FRAME):
        raise ProtocolError(f"unknown msgpack ext type {code} (arrays are {ARRAY_INLINE} inline, {ARRAY_FRAME} out-of-band)")
    try:
        meta = msgpack.unpackb(data, raw=False, strict_map_key=True, max_str_len=64, max_array_len=64, max_map_len=0)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"array ext is not valid msgpack: {type(exc).__name__} {exc}") from None
    if not (isinstance(meta, list) and len(meta) == 3):
        raise ProtocolError("array ext must be [dtype, shape, data]")
    return _ArrayRef(code, meta[0], meta[1], meta[2])


def _decode(frames: Sequence[Any], limits: Limits, expect: Any) -> Any:
    if not frames:
        raise ProtocolError("empty message: no frames")
    bufs = [_buffer(f) for f in frames]
    total = sum(b.nbytes for b in bufs)
    if total > limits.max_message_bytes:
        raise ProtocolError(f"message is {total} bytes, over the limit of {limits.max_message_bytes}")
    if bufs[0].nbytes > limits.max_header_bytes:
        raise ProtocolError(f"header frame is {bufs[0].nbytes} bytes, over {limits.max_header_bytes}")
    try:
        env = msgpack.unpackb(
            bufs[0],
            raw=False,
            strict_map_key=True,
            ext_hook=_ext_hook,
            max_str_len=limits.max_items,
            max_bin_len=limits.max_header_bytes,
            max_array_len=limits.max_items,
            max_map_len=limits.max_items,
            max_ext_len=limits.max_header_bytes,  # inline arrays: checked per field
        )
    except ProtocolError:
        raise
    except msgpack.StackError:
        raise ProtocolError("not valid msgpack: message nests too deeply") from None
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"not valid msgpack: {type(exc).__name__} {exc}") from None

    if not isinstance(env, dict) or set(env) != {"v", "t", "b"}:
        raise ProtocolError("envelope must be a map with exactly keys v, t, b")
    if type(env["v"]) is not int or env["v"] != SCHEMA_VERSION:
        raise ProtocolError(f"schema version {env['v']!r} != {SCHEMA_VERSION}; upgrade the older side")
    cls = REGISTRY.get(env["t"]) if isinstance(env["t"], str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {env['t']!r}")
    if expect is not None and not issubclass(cls, expect):
        raise ProtocolError(f"got {cls.__name__}, expected {_names(expect)}")
    ctx = _Ctx(bufs, limits)
    obj = _build(cls, env["b"], cls.__name__, ctx)
    if len(ctx.used) != len(bufs) - 1:
        unused = sorted(set(range(1, len(bufs))) - ctx.used)
        raise ProtocolError(f"{cls.__name__}: frame(s) {unused} not referenced by any array field")
    return obj


def _array(ref: _ArrayRef, path: str, ctx: _Ctx) -> np.ndarray:
    """Validate an array ext and view its bytes without copying."""
    if not isinstance(ref.dtype, str) or not isinstance(ref.shape, list):
        raise ProtocolError(f"{path}: array ext must be [dtype: str, shape: list, data]")
    try:
        dtype = np.dtype(ref.dtype)
    except (TypeError, ValueError, SyntaxError):
        raise ProtocolError(f"{path}: unknown dtype {ref.dtype!r}") from None
    if dtype not in _ALLOWED_DTYPES:
        raise ProtocolError(f"{path}: dtype {ref.dtype!r} is not allowed on the wire")
    shape = ref.shape
    if len(shape) > 8 or not all(type(d) is int and d >= 0 for d in shape):
        raise ProtocolError(f"{path}: bad array shape {shape!r}")
    count = 1
    for d in shape:
        count *= d
    nbytes = count * dtype.itemsize
    if nbytes > ctx.limits.max_array_bytes or max(shape, default=0) > ctx.limits.max_array_bytes:
        raise ProtocolError(f"{path}: array of shape {shape} ({nbytes} bytes) is over the limit of {ctx.limits.max_array_bytes} bytes")
    if ref.code == ARRAY_INLINE:
        raw = ref.data
        if not isinstance(raw, bytes):
            raise ProtocolError(f"{path}: inline array data must be bytes")
    else:
        idx = ref.data
        if type(idx) is not int or not 1 <= idx < len(ctx.bufs):
            raise ProtocolError(f"{path}: array refers to frame {idx!r}, which is missing")
        if idx in ctx.used:
            raise ProtocolError(f"{path}: array refers to frame {idx}, which another array already used")
        ctx.used.add(idx)
        raw = ctx.bufs[idx]
    if len(raw) != nbytes:
        raise ProtocolError(f"{path}: array data is {len(raw)} bytes, shape {shape} of {dtype.name} needs {nbytes}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def _names(expect: Any) -> str:
    if isinstance(expect, tuple):
        return " or ".join(e.__name__ for e in expect)
    return expect.__name__


@lru_cache(maxsize=None)
def _schema(cls: type) -> tuple[tuple[str, Any, dict, bool], ...]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out.append((f.name, hints[f.name], dict(f.metadata), required))
    return tuple(out)


def _build(cls: type, body: Any, path: str, ctx: _Ctx) -> Any:
    if not isinstance(body, dict):
        raise ProtocolError(f"{path}: expected a map, got {type(body).__name__}")
    schema = _schema(cls)
    known = {name for name, *_ in schema}
    unknown = [k for k in body if k not in known]
    if unknown:
        raise ProtocolError(f"{path}: unknown field(s) {unknown!r}")
    kwargs = {}
    for name, tp, meta, required in schema:
        if name not in body:
            if required:
                raise ProtocolError(f"{path}.{name}: missing required field")
            continue
        kwargs[name] = _convert(tp, body[name], f"{path}.{name}", meta, ctx)
    try:
        obj = cls(**kwargs)
    except ProtocolError:
        raise
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"{path}: {exc}") from None
    check = getattr(obj, "check", None)
    if check is not None:
        try:
            check()
        except ProtocolError as exc:
            if path == cls.__name__:
                raise
            raise ProtocolError(f"{path}: {exc}") from None  # nested: say where it sits
    return obj


def _convert(tp: Any, value: Any, path: str, meta: dict, ctx: _Ctx) -> Any:
    origin = typing.get_origin(tp)
    if isinstance(value, _ArrayRef):
        if tp is not np.ndarray:
            raise ProtocolError(f"{path}: expected {_type_name(tp)}, got an array")
        value = _array(value, path, ctx)
    if tp is np.ndarray:
        if not isinstance(value, np.ndarray):
            raise ProtocolError(f"{path}: expected an array, got {type(value).__name__}")
        want = meta.get("dtype")
        if want is not None and value.dtype != want:
            raise ProtocolError(f"{path}: dtype {value.dtype.name}, expected {want.name}")
        ndim = meta.get("ndim")
        if ndim is not None and value.ndim != ndim:
            raise ProtocolError(f"{path}: {value.ndim}-d array, expected {ndim}-d")
        return value
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ProtocolError(f"{path}: must not be null")
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(a, value, path, meta, ctx)
            except ProtocolError as e:
                errors.append(str(e))
        raise ProtocolError(errors[0] if len(errors) == 1 else f"{path}: matches none of {_type_name(tp)}")
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"{path}: expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(tp)
        return [_convert(item, v, f"{path}[{i}]", meta, ctx) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{path}: expected a map, got {type(value).__name__}")
        kt, vt = typing.get_args(tp)
        return {_convert(kt, k, f"{path}.<key>", {}, ctx): _convert(vt, v, f"{path}[{k!r}]", meta, ctx) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, ctx)
    if tp is bool:
        if not isinstance(value, bool):
            raise ProtocolError(f"{path}: expected bool, got {type(value).__name__}")
        return value
    if tp is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ProtocolError(f"{path}: expected int, got {type(value).__name__}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(f"{path}: expected float, got {type(value).__name__}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ProtocolError(f"{path}: expected str, got {type(value).__name__}")
        return value
    if tp is bytes:
        if not isinstance(value, bytes):
            raise ProtocolError(f"{path}: expected bytes, got {type(value).__name__}")
        return value
    raise ProtocolError(f"{path}: unsupported field type {tp!r}")  # a schema bug, caught by tests


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
