"""MessagePack encoding of ``protocol.messages`` records, strict on decode.

Wire format: a list of frames.  Frame 0 is a msgpack map ``{"v": SCHEMA_VERSION,
"t": "<RecordName>", "b": {field: value, ...}}``.  Nested records are maps; numpy
arrays are msgpack ext values: ``ARRAY_INLINE`` carries ``[dtype, shape, bytes]``,
``ARRAY_FRAME`` carries ``[dtype, shape, frame_index, byte_offset]`` and the raw bytes
lie in a later frame at that offset (sent with ZeroMQ ``copy=False``; decoded with
``np.frombuffer`` over the received buffer, never copied on the receiving side).

Out-of-band arrays are *packed* (schema 5): every array of at least
``out_of_band_bytes`` and under ``own_frame_bytes`` is copied, 8-byte aligned, into one
shared data frame (one frame per message instead of one per array: pyzmq's cost per
zero-copy frame, paid on both sides, dominated a trajectory group's transport);
arrays of ``own_frame_bytes`` or more get a frame of their own, a view of the array
(no copy on either side).  Arrays carved from one buffer (``protocol.arena.Arena``, as
the actor builds a trajectory group) that tile a region of it of ``own_frame_bytes`` or
more travel as that region, one zero-copy frame, whatever their own sizes: a large group
is a header and a few frames (the same wire format: an ``ARRAY_FRAME`` is an offset into
any frame).  A message with exactly one out-of-band array sends that
array's own bytes as frame 1 (``WeightChunk``: the actor ``recv_into``'s it).  The
decoder accepts any layout that is well formed: each array's bytes lie inside its
frame, arrays never overlap, and every data frame is referenced.

Frame 0 is parsed by msgspec when it is at most ``Limits.max_items`` bytes long (it then
cannot hold any list, map or string over the limits), by msgpack-python with every limit
otherwise.  Decoding checks, in order: total size, msgpack validity, envelope, schema version,
type name, then every field against the record's annotations (exact dtype, ndim,
element count against the frame size, no unknown or missing fields), then the record's
own ``check()``.  A record whose fields are all scalars takes a fast path when its map
holds exactly its fields, in field order, each of exactly the annotated type (what
``encode`` writes): two tuple comparisons instead of per-field checks; any other map is
checked field by field, so the rules and messages are the same either way.
Anything wrong raises ``ProtocolError`` naming the field path (values
quoted in messages are cut to a few dozen characters); no other exception escapes
``decode``.  No pickle anywhere.

Decoded arrays are views of the received frames (writable over a ``zmq.Frame``,
read-only over ``bytes``; over the sender's own arrays when frames are decoded
in-process), never copies: copy one before changing it.  A view keeps its frame alive.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

import msgpack
import msgspec
import numpy as np

from turnscale.protocol.errors import ProtocolError
from turnscale.protocol.messages import REGISTRY, SCHEMA_VERSION

ARRAY_INLINE = 1
ARRAY_FRAME = 2
OUT_OF_BAND_BYTES = 16 * 1024
"""Arrays at least this large travel out of band (in a data frame, not in frame 0)."""
OWN_FRAME_BYTES = 64 << 10
"""Out-of-band arrays at least this large get a zero-copy frame of their own; smaller
ones are copied into the one shared data frame."""
_ALIGN = 8

_ALLOWED_DTYPES = frozenset(
    np.dtype(d) for d in ("uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "float16", "float32", "float64", "bool")
)

_WIRE_DTYPES = {d.str: d for d in _ALLOWED_DTYPES}
"""What the encoder writes (``arr.dtype.str``, e.g. ``<i4``) -> dtype, to skip parsing."""


@dataclass(frozen=True, slots=True)
class Limits:
    """Decoding limits; anything larger is a ``ProtocolError``, checked before decoding.
    Sockets also set ZeroMQ's ``MAXMSGSIZE`` (``SocketLimits``), which stops an oversize
    *frame* before Python sees it; the total of a multipart message is checked here."""

    max_message_bytes: int = 1 << 30
    """Sum of all frames of one message."""
    max_array_bytes: int = 1 << 30
    """One array's bytes."""
    max_header_bytes: int = 64 << 20
    """Frame 0 (the msgpack part)."""
    max_items: int = 1 << 20
    """Elements in one list/map and characters in one string."""
    max_frames: int = 1024
    """Frames of one message (frame 0 and the data frames).  A trajectory group is a
    header and a few data frames (``protocol.arena``); even without an arena each episode
    adds at most one frame per array (4), so 1024 holds a group of 255 episodes.  Receivers
    check it while receiving (``AsyncSocket.recv_multipart(max_frames=...)``), so a
    message of many tiny frames is neither kept nor decoded; ``decode`` checks it first."""


DEFAULT_LIMITS = Limits()

# ----------------------------------------------------------------------------- encode


def encode(msg: Any, *, out_of_band_bytes: int = OUT_OF_BAND_BYTES,
           own_frame_bytes: int = OWN_FRAME_BYTES) -> list[bytes | memoryview]:
    """Encode a registered record into frames (frame 0 msgpack, then data frames).

    Arrays of at least ``out_of_band_bytes`` travel out of band: packed into one shared
    data frame (a copy) or, from ``own_frame_bytes`` up or when they are the message's
    only out-of-band array, as a ``memoryview`` of the array itself (no copy; send with
    ``copy=False`` and keep the record alive until ZeroMQ is done, which pyzmq's
    zero-copy frames do by holding a reference).  Views of one buffer that tile a region
    of it (``protocol.arena``) travel as that region, one zero-copy frame (``_layout``)."""
    name = type(msg).__name__
    if REGISTRY.get(name) is not type(msg):
        raise ProtocolError(f"cannot encode {type(msg)!r}: not a protocol.messages record")
    frames: list[bytes | memoryview] = [b""]
    oob: list[_LateExt] = []  # arrays placed by ``_layout`` once all are known

    def array(obj: Any) -> Any:
        if not isinstance(obj, np.ndarray):
            return obj  # not what the annotation says: msgpack (or ``default``) decides
        if obj.dtype not in _ALLOWED_DTYPES:
            raise ProtocolError(f"cannot encode an array of dtype {obj.dtype} in {name}: not allowed on the wire")
        arr = np.ascontiguousarray(obj)
        owner = arr.base
        shared = bool(arr.nbytes) and isinstance(owner, np.ndarray) and owner.base is None and owner.flags.c_contiguous
        if shared or arr.nbytes >= out_of_band_bytes:  # a view of a buffer is placed by ``_layout``
            late = _LateExt([arr.dtype.str, list(arr.shape), 0, 0], arr, shared)
            oob.append(late)
            return late
        return _ext(ARRAY_INLINE, _pack_meta([arr.dtype.str, arr.shape, arr.tobytes()]))

    def default(obj: Any) -> Any:  # values that do not match their annotation
        if type(obj) is _LateExt:
            if obj.inline:
                a = obj.arr
                return _ext(ARRAY_INLINE, _pack_meta([a.dtype.str, a.shape, a.tobytes()]))
            return _ext(ARRAY_FRAME, _pack_meta(obj.meta))
        if isinstance(obj, np.ndarray):  # an array where the annotation wants none: the decoder refuses it
            return msgpack.ExtType(ARRAY_INLINE, msgpack.packb([obj.dtype.str, list(obj.shape), obj.tobytes()]))
        names = _field_names(type(obj))
        if names is not None:
            return {n: getattr(obj, n) for n in names}
        if isinstance(obj, (np.integer,)):
            return int(obj)
        if isinstance(obj, (np.floating,)):
            return float(obj)
        raise ProtocolError(f"cannot encode value of type {type(obj).__name__} in {name}")

    try:
        body = _plain_converter(type(msg))(msg, array)
        if oob:
            _layout(oob, frames, out_of_band_bytes, own_frame_bytes)
        frames[0] = msgpack.packb({"v": SCHEMA_VERSION, "t": name, "b": body}, default=default, use_bin_type=True)
    except ProtocolError:
        raise
    except (TypeError, ValueError, OverflowError, AttributeError) as exc:  # e.g. an int beyond 64 bits
        raise ProtocolError(f"cannot encode {name}: {type(exc).__name__} {exc}") from None
    return frames


_pack_meta = msgspec.msgpack.Encoder().encode
"""An array ext's ``[dtype, shape, ...]`` payload (str, ints, bytes: the same bytes as
``msgpack.packb`` writes, without building a packer per array)."""


def _ext(code: int, data: bytes) -> msgpack.ExtType:
    """``msgpack.ExtType(code, data)`` without its argument checks (our own int and bytes)."""
    return tuple.__new__(msgpack.ExtType, (code, data))


class _LateExt:
    """An array's ext, packed once ``_layout`` has placed it: out of band (its frame and
    offset in ``meta``) or, for a small view of a buffer that is not sent whole, inline."""

    __slots__ = ("meta", "arr", "shared", "inline", "address")

    def __init__(self, meta: list, arr: np.ndarray, shared: bool) -> None:
        self.meta, self.arr, self.shared, self.inline = meta, arr, shared, False
        self.address = 0
        """The array's data address, once ``_layout`` needs it (~1 us to read: read once)."""


def _layout(oob: list[_LateExt], frames: list, out_of_band_bytes: int, own_frame_bytes: int) -> None:
    """Place each array of ``oob`` (filling in its ext), appending data frames to ``frames``.

    Views of one buffer (``shared``: carved from one ``protocol.arena.Arena``) that tile a
    region of it of at least ``own_frame_bytes`` travel as that region, one zero-copy frame,
    whatever their own sizes.  Every other array is placed by size: under
    ``out_of_band_bytes`` inline in frame 0, from ``own_frame_bytes`` up a zero-copy frame of
    its own, in between copied into one shared frame (``_pack``; a lone array is its own frame)."""
    rest: list[_LateExt] = []
    by_owner: dict[int, list[_LateExt]] = {}
    for late in oob:
        if late.shared:
            by_owner.setdefault(id(late.arr.base), []).append(late)
        else:
            rest.append(late)
    for items in by_owner.values():
        owner = items[0].arr.base
        region = None
        if len(items) > 1:
            start = _address(owner)
            for late in items:
                late.address = _address(late.arr) - start
            region = _tiles(items)
        if region is None or region[1] - region[0] < own_frame_bytes:  # small: copying is cheaper
            for late in items:
                if late.arr.nbytes < out_of_band_bytes:
                    late.inline = True
                else:
                    rest.append(late)
            continue
        lo, hi = region
        frames.append(memoryview(owner.reshape(-1).view(np.uint8)[lo:hi]))
        for late in items:
            late.meta[2], late.meta[3] = len(frames) - 1, late.address - lo
    packed = []
    for late in rest:
        if late.arr.nbytes >= own_frame_bytes:
            frames.append(memoryview(late.arr.reshape(-1).view(np.uint8)))
            late.meta[2] = len(frames) - 1
        else:
            packed.append((late.meta, late.arr))
    if packed:
        _pack(packed, frames)


def _address(arr: np.ndarray) -> int:
    return arr.__array_interface__["data"][0]


def _tiles(items: list[_LateExt]) -> tuple[int, int] | None:
    """``(start, end)``: the byte region of the arrays' common owner that they
    tile, separated by under ``_ALIGN`` bytes of padding (so the frame carries nothing but
    them), each at an offset from ``start`` aligned to its item size (as the decoder
    requires); None when they do not.  Each item's ``address`` is its offset in the owner."""
    spans = sorted(((late.address, late.arr) for late in items), key=lambda x: x[0])
    lo = pos = spans[0][0]
    for start, arr in spans:
        if not 0 <= start - pos < _ALIGN or (start - lo) % arr.dtype.itemsize:
            return None
        pos = start + arr.nbytes
    return lo, pos


def _pack(packed: list[tuple[list, np.ndarray]], frames: list) -> None:
    """Lay the arrays of ``packed`` into one data frame (8-byte aligned) and point their
    ext metas at it; a lone array is sent as itself (no copy)."""
    index = len(frames)
    if len(packed) == 1:
        meta, arr = packed[0]
        frames.append(memoryview(arr.reshape(-1).view(np.uint8)))
        meta[2] = index
        return
    pos = 0
    for meta, arr in packed:
        meta[2], meta[3] = index, pos
        pos += -(-arr.nbytes // _ALIGN) * _ALIGN
    buf = np.empty(pos, np.uint8)
    for meta, arr in packed:
        buf[meta[3]:meta[3] + arr.nbytes] = arr.reshape(-1).view(np.uint8)
    frames.append(memoryview(buf))


@lru_cache(maxsize=None)
def _plain_converter(cls: type) -> Any:
    """A function ``(record, array) -> dict`` generated once from ``cls``'s annotations:
    nested records become maps, arrays go through ``array``, everything else is left to
    msgpack.  (The generic path, msgpack's ``default`` hook per record, costs several
    times more for a group of hundreds of records.)"""
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    if _dict_backed(cls) and all(hints[f.name] in (str, int, bool, bytes, float) for f in fields):
        n = len(fields)

        def plain_dict(o: Any, array: Any) -> dict:
            d = o.__dict__  # exactly the fields, in field order (``messages.record(slots=False)``)
            return d if len(d) == n else {f.name: getattr(o, f.name) for f in fields}

        return plain_dict
    ns: dict[str, Any] = {}
    items = []
    for i, f in enumerate(dataclasses.fields(cls)):
        tp, expr = hints[f.name], f"o.{f.name}"
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if tp is np.ndarray:
            value = f"array({expr})"
        elif dataclasses.is_dataclass(tp):
            ns[f"p{i}"] = _plain_converter(tp)
            value = f"p{i}({expr}, array)"
        elif origin is list and dataclasses.is_dataclass(args[0]):
            ns[f"p{i}"] = _plain_converter(args[0])
            value = f"[p{i}(x, array) for x in {expr}]"
        elif origin in (types.UnionType, typing.Union) and len(args) == 2 and type(None) in args and dataclasses.is_dataclass(args[0]):
            ns[f"p{i}"] = _plain_converter(args[0])
            value = f"(None if {expr} is None else p{i}({expr}, array))"
        else:
            value = expr
        items.append(f"{f.name!r}: {value}")
    exec(f"def plain(o, array):\n    return {{{', '.join(items)}}}", ns)  # noqa: S102 - our own annotations only
    return ns["plain"]


def _dict_backed(cls: type) -> bool:
    """A record without slots, whose instances keep their fields in ``__dict__``
    (``messages.record(slots=False)``), and no ``__post_init__`` to run."""
    return "__slots__" not in cls.__dict__ and not hasattr(cls, "__post_init__")


@lru_cache(maxsize=None)
def _field_names(cls: type) -> tuple[str, ...] | None:
    """Field names of a dataclass type (None for anything else), computed once per type."""
    if not dataclasses.is_dataclass(cls):
        return None
    return tuple(f.name for f in dataclasses.fields(cls))


# ----------------------------------------------------------------------------- decode


def _buffer(frame: Any) -> memoryview:
    """A flat byte view of one frame (``bytes``, ``memoryview``, ``zmq.Frame``), no copy."""
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    mv = memoryview(frame if buf is None else buf)
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")  # e.g. a memoryview of a float32 array: count bytes, not items
    return mv


def _short(value: Any, limit: int = 80) -> str:
    """``repr`` bounded in length: error messages are logged and sent back to peers."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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


class _ArrayRef:
    """An array ext as parsed from frame 0; validated (dtype, shape, size, frame) only once
    the field it sits in is known, so every error names the field path.  (A plain slotted
    class: a frozen dataclass's ``__init__`` costs a few us per array.)"""

    __slots__ = ("code", "dtype", "shape", "data", "offset")

    def __init__(self, code: int, dtype: Any, shape: Any, data: Any, offset: Any) -> None:
        self.code, self.dtype, self.shape, self.data, self.offset = code, dtype, shape, data, offset


class _Ctx:
    """Per-message decoding state: the frames, the limits, which frames arrays used."""

    __slots__ = ("bufs", "limits", "used")

    def __init__(self, bufs: list[memoryview], limits: Limits) -> None:
        self.bufs = bufs
        self.limits = limits
        self.used: dict[int, list[tuple[int, int]]] = {}
        """Frame -> (start, end) byte span of every array read from it."""


def _ext_hook(code: int, data: bytes) -> Any:
    if code not in (ARRAY_INLINE, ARRAY_FRAME):
        raise ProtocolError(f"unknown msgpack ext type {code} (arrays are {ARRAY_INLINE} inline, {ARRAY_FRAME} out-of-band)")
    try:
        meta = msgpack.unpackb(data, raw=False, strict_map_key=True, max_str_len=64, max_array_len=64, max_map_len=0)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"array ext is not valid msgpack: {type(exc).__name__} {exc}") from None
    if code == ARRAY_INLINE:
        if not (isinstance(meta, list) and len(meta) == 3):
            raise ProtocolError("array ext must be [dtype, shape, data]")
        return _ArrayRef(code, meta[0], meta[1], meta[2], 0)
    if not (isinstance(meta, list) and len(meta) == 4):  # e.g. schema 4's [dtype, shape, frame]: named after the version check
        return _ArrayRef(0, None, None, None, None)
    return _ArrayRef(code, meta[0], meta[1], meta[2], meta[3])


def _decode(frames: Sequence[Any], limits: Limits, expect: Any) -> Any:
    if not frames:
        raise ProtocolError("empty message: no frames")
    if len(frames) > limits.max_frames:
        raise ProtocolError(f"message has {len(frames)} frames, over the limit of {limits.max_frames}")
    bufs = [_buffer(f) for f in frames]
    total = sum(b.nbytes for b in bufs)
    if total > limits.max_message_bytes:
        raise ProtocolError(f"message is {total} bytes, over the limit of {limits.max_message_bytes}")
    if bufs[0].nbytes > limits.max_header_bytes:
        raise ProtocolError(f"header frame is {bufs[0].nbytes} bytes, over {limits.max_header_bytes}")
    if bufs[0].nbytes <= limits.max_items:
        env = _parse_small_header(bufs[0])
    else:
        env = _parse_header(bufs[0], limits)
    return _build(env, bufs, limits, expect)


_SMALL_HEADER_DECODER = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


def _parse_small_header(buf: memoryview) -> Any:
    """Frame 0 parsed by msgspec (about half of msgpack-python's time on a group header).
    msgspec has no per-container limits, and needs none here: every list or map element
    and every string or binary byte takes at least one byte of the frame, so a frame of at
    most ``max_items`` bytes holds nothing over ``max_items`` (nor over
    ``max_header_bytes``).  It accepts non-string map keys, which the record converters
    then refuse as unknown fields (every map on the wire is a record or a typed dict)."""
    try:
        return _SMALL_HEADER_DECODER.decode(buf)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"not valid msgpack: {exc}") from None


def _parse_header(buf: memoryview, limits: Limits) -> Any:
    """Frame 0 parsed by msgpack-python with every limit of ``limits`` enforced."""
    try:
        return msgpack.unpackb(
            buf,
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


def _build(env: Any, bufs: list[memoryview], limits: Limits, expect: Any) -> Any:
    if not isinstance(env, dict) or set(env) != {"v", "t", "b"}:
        raise ProtocolError("envelope must be a map with exactly keys v, t, b")
    if type(env["v"]) is not int or env["v"] != SCHEMA_VERSION:
        raise ProtocolError(f"schema version {_short(env['v'])} != {SCHEMA_VERSION}; upgrade the older side")
    cls = REGISTRY.get(env["t"]) if isinstance(env["t"], str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {_short(env['t'])}")
    if expect is not None and not issubclass(cls, expect):
        raise ProtocolError(f"got {cls.__name__}, expected {_names(expect)}")
    ctx = _Ctx(bufs, limits)
    obj = _build_root(cls, env["b"], ctx)
    if len(ctx.used) != len(bufs) - 1:
        unused = sorted(set(range(1, len(bufs))) - set(ctx.used))
        listed = ", ".join(map(str, unused[:8])) + (f", ... ({len(unused)} in all)" if len(unused) > 8 else "")
        raise ProtocolError(f"{cls.__name__}: frame(s) [{listed}] not referenced by any array field")
    for idx, spans in ctx.used.items():
        if len(spans) > 1:
            spans.sort()
            for (_, end), (start, _) in zip(spans, spans[1:]):
                if start < end:
                    raise ProtocolError(f"{cls.__name__}: an array overlaps another one in frame {idx} (at byte {start})")
    return obj


def _array(ref: _ArrayRef, ctx: _Ctx) -> np.ndarray:
    """Validate an array ext and view its bytes without copying."""
    if not ref.code:
        raise _Bad("array ext must be [dtype, shape, frame, offset]")
    if not isinstance(ref.dtype, str) or not isinstance(ref.shape, list):
        raise _Bad("array ext must be [dtype: str, shape: list, data]")
    dtype = _WIRE_DTYPES.get(ref.dtype)
    if dtype is None:
        try:
            parsed = np.dtype(ref.dtype)
        except (TypeError, ValueError, SyntaxError):
            raise _Bad(f"unknown dtype {_short(ref.dtype)}") from None
        if parsed not in _ALLOWED_DTYPES:
            raise _Bad(f"dtype {_short(ref.dtype)} is not allowed on the wire")
        dtype = parsed
    shape = ref.shape
    if len(shape) == 1:  # the common case, checked without a generator
        count = largest = shape[0]
        if type(count) is not int or count < 0:
            raise _Bad(f"bad array shape {_short(shape)}")
    else:
        if len(shape) > 8 or not all(type(d) is int and d >= 0 for d in shape):
            raise _Bad(f"bad array shape {_short(shape)}")
        count = 1
        for d in shape:
            count *= d
        largest = max(shape, default=0)
    nbytes = count * dtype.itemsize
    if nbytes > ctx.limits.max_array_bytes or largest > ctx.limits.max_array_bytes:
        raise _Bad(f"array of shape {shape} ({nbytes} bytes) is over the limit of {ctx.limits.max_array_bytes} bytes")
    if ref.code == ARRAY_INLINE:
        raw = ref.data
        if not isinstance(raw, bytes):
            raise _Bad("inline array data must be bytes")
    else:
        idx, off = ref.data, ref.offset
        if type(idx) is not int or not 1 <= idx < len(ctx.bufs):
            raise _Bad(f"array refers to frame {_short(idx)}, which is missing")
        if type(off) is not int or off < 0 or off % dtype.itemsize:
            raise _Bad(f"array offset {_short(off)} in frame {idx} must be a non-negative multiple of {dtype.itemsize}")
        frame = ctx.bufs[idx]
        if off + nbytes > frame.nbytes:
            raise _Bad(f"array data is {max(frame.nbytes - off, 0)} bytes, shape {shape} of {dtype.name} needs {nbytes} "
                       f"(frame {idx}, offset {off})")
        ctx.used.setdefault(idx, []).append((off, off + nbytes))
        arr = np.frombuffer(frame, dtype=dtype, count=count, offset=off)
        return arr if len(shape) == 1 else arr.reshape(shape)
    if len(raw) != nbytes:
        raise _Bad(f"array data is {len(raw)} bytes, shape {shape} of {dtype.name} needs {nbytes}")
    arr = np.frombuffer(raw, dtype=dtype)
    return arr if len(shape) == 1 else arr.reshape(shape)


def _names(expect: Any) -> str:
    if isinstance(expect, tuple):
        return " or ".join(e.__name__ for e in expect)
    return expect.__name__


class _Bad(Exception):
    """Internal: a field is invalid.  ``where`` collects the path segments while the
    error unwinds (``.episodes``, ``[3]``, ``.loss_mask``); ``decode`` turns it into a
    ``ProtocolError`` naming ``TrajectoryGroup.episodes[3].loss_mask``.  Keeping the path
    out of the success path makes decoding a field a few attribute lookups."""

    def __init__(self, msg: str, *, whole: bool = False) -> None:
        super().__init__(msg)
        self.msg = msg
        self.where: list[str] = []
        self.whole = whole
        """``msg`` already names its field (a record's ``check``)."""

    def at(self, segment: str) -> _Bad:
        self.where.append(segment)
        return self

    def message(self, root: str) -> str:
        if self.whole and not self.where:
            return self.msg
        return f"{root}{''.join(reversed(self.where))}: {self.msg}"


def _kind(value: Any) -> str:
    return "an array" if isinstance(value, (_ArrayRef, np.ndarray)) else type(value).__name__


Converter = Any  # Callable[[Any, _Ctx], Any]


def _build_root(cls: type, body: Any, ctx: _Ctx) -> Any:
    try:
        return _record_converter(cls)(body, ctx)
    except _Bad as bad:
        raise ProtocolError(bad.message(cls.__name__)) from None


@lru_cache(maxsize=None)
def _record_converter(cls: type) -> Converter:
    """A function ``(body, ctx) -> record`` for ``cls``, generated once from its annotations.

    Scalar fields (``str``, ``int``, ``bool``, ``float``) are checked inline; other fields
    call their converter.  Semantics are exactly those of ``_converter``: the generated
    code only saves the per-field calls and loops (a group holds hundreds of records)."""
    hints = typing.get_type_hints(cls)
    names = {"cls": cls, "_Bad": _Bad, "_kind": _kind, "_short": _short, "check": getattr(cls, "check", None), "ProtocolError": ProtocolError}
    known = frozenset(f.name for f in dataclasses.fields(cls))
    names["known"] = known
    body = [
        "def convert(body, ctx):",
        "    if type(body) is not dict:",
        "        raise _Bad(f'expected a map, got {_kind(body)}')",
        "    if not known.issuperset(body):",
        "        raise _Bad(f'unknown field(s) {_short([k for k in body if k not in known])}')",
    ]
    args = []
    for i, f in enumerate(dataclasses.fields(cls)):
        tp, v, seg = hints[f.name], f"v{i}", "." + f.name
        if f.default is not dataclasses.MISSING:
            names[f"d{i}"] = f.default
            body += [f"    {v} = body[{f.name!r}] if {f.name!r} in body else d{i}"]
            optional = True
        elif f.default_factory is not dataclasses.MISSING:
            names[f"d{i}"] = f.default_factory
            body += [f"    {v} = body[{f.name!r}] if {f.name!r} in body else d{i}()"]
            optional = True
        else:
            body += [f"    if {f.name!r} not in body:", f"        raise _Bad('missing required field').at({seg!r})", f"    {v} = body[{f.name!r}]"]
            optional = False
        guard = f"{v} is not d{i} and " if optional else ""  # a default is valid as it is
        if tp in (str, int, bool, bytes):
            names[f"t{i}"] = tp
            body += [f"    if {guard}type({v}) is not t{i}:", f"        raise _Bad(f'expected {tp.__name__}, got {{_kind({v})}}').at({seg!r})"]
        elif tp is float:
            body += [
                f"    if {guard}type({v}) is not float:",
                f"        if type({v}) is int:",
                f"            {v} = float({v})",
                "        else:",
                f"            raise _Bad(f'expected float, got {{_kind({v})}}').at({seg!r})",
            ]
        else:
            meta = f.metadata
            names[f"c{i}"] = _converter(tp, meta.get("dtype"), meta.get("ndim"))
            call = ["    try:", f"        {v} = c{i}({v}, ctx)", "    except _Bad as bad:", f"        raise bad.at({seg!r}) from None"]
            if optional:
                call = [f"    if {v} is not d{i}:"] + ["    " + line for line in call]
            body += call
        args.append(f"{f.name}={v}")
    fields = dataclasses.fields(cls)
    scalar = all(hints[f.name] in (str, int, bool, bytes, float) for f in fields)
    if _dict_backed(cls) and scalar:
        # A dict-backed record (``messages.record(slots=False)``): every field was checked
        # above; its ``__dict__`` is a fresh map of them in field order.  The whole-record
        # fast path adopts the decoded map itself as the ``__dict__`` once it holds every
        # field, in field order, each of exactly its annotated type.
        names["_new"], names["_setdict"] = object.__new__, object.__setattr__
        names["order"] = tuple(f.name for f in fields)
        names["types"] = tuple(hints[f.name] for f in fields)
        body += ["    obj = _new(cls)", f"    _setdict(obj, '__dict__', {{{', '.join(f'{f.name!r}: v{i}' for i, f in enumerate(fields))}}})"]
        fast = [
            "    if type(body) is dict and tuple(body) == order and tuple(map(type, body.values())) == types:",
            "        obj = _new(cls)",
            "        _setdict(obj, '__dict__', body)",
            "        return obj" if getattr(cls, "check", None) is None else "        return _finish(obj)",
        ]
        body[1:1] = fast
    elif "__slots__" in cls.__dict__ and not hasattr(cls, "__post_init__"):
        # Every field was checked above: fill the slots directly, as the frozen
        # dataclass __init__ would (it costs an object.__setattr__ call per field).
        names["_new"] = object.__new__
        fill = ["    obj = _new(cls)"]
        for i, f in enumerate(fields):
            names[f"s{i}"] = cls.__dict__[f.name].__set__
            fill += [f"    s{i}(obj, v{i})"]
        body += fill
        if scalar:
            # Whole-record fast path: the map holds every field, in the encoder's order,
            # each of exactly its annotated type (what our own encoder always writes);
            # two C-level tuple comparisons replace the per-field checks.  Anything else
            # (a missing default, an int for a float, another key order, a bad value)
            # takes the field-by-field path above, which names what is wrong.
            names["order"] = tuple(f.name for f in fields)
            names["types"] = tuple(hints[f.name] for f in fields)
            fast = [
                "    if type(body) is dict and tuple(body) == order and tuple(map(type, body.values())) == types:",
                f"        {', '.join(f'v{i}' for i in range(len(fields)))}{',' if len(fields) == 1 else ''} = body.values()",
                *("    " + line for line in fill),
                "        return obj" if getattr(cls, "check", None) is None else "        return _finish(obj)",
            ]
            body[1:1] = fast
    else:
        body += [
            "    try:",
            f"        obj = cls({', '.join(args)})",
            "    except (TypeError, ValueError) as exc:",
            "        raise _Bad(str(exc)) from None",
        ]
    body += ["    return _finish(obj)"]
    body += [
        "def _finish(obj):",
        "    if check is not None:",
        "        try:",
        "            check(obj)",
        "        except ProtocolError as exc:",
        "            raise _Bad(str(exc), whole=True) from None",
        "    return obj",
    ]
    exec("\n".join(body), names)  # noqa: S102 - code generated from our own annotations only
    return names["convert"]


@lru_cache(maxsize=None)
def _converter(tp: Any, dtype: Any = None, ndim: Any = None) -> Converter:
    """A function ``(value, ctx) -> value`` that checks one annotated field type."""
    origin = typing.get_origin(tp)
    if tp is np.ndarray:

        def conv_array(value: Any, ctx: _Ctx) -> Any:
            if type(value) is not _ArrayRef:
                raise _Bad(f"expected an array, got {_kind(value)}")
            arr = _array(value, ctx)
            if dtype is not None and arr.dtype != dtype:
                raise _Bad(f"dtype {arr.dtype.name}, expected {dtype.name}")
            if ndim is not None and arr.ndim != ndim:
                raise _Bad(f"{arr.ndim}-d array, expected {ndim}-d")
            return arr

        return conv_array
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        nullable = type(None) in args
        inner = [_converter(a, dtype, ndim) for a in args if a is not type(None)]

        def conv_union(value: Any, ctx: _Ctx) -> Any:
            if value is None:
                if nullable:
                    return None
                raise _Bad("must not be null")
            if len(inner) == 1:
                return inner[0](value, ctx)
            for c in inner:
                try:
                    return c(value, ctx)
                except _Bad:
                    continue
            raise _Bad(f"matches none of {_type_name(tp)}")

        return conv_union
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        item = _converter(item_tp, dtype, ndim)

        def conv_list(value: Any, ctx: _Ctx) -> Any:
            if type(value) is not list:
                raise _Bad(f"expected a list, got {_kind(value)}")
            out = []
            for i, v in enumerate(value):
                try:
                    out.append(item(v, ctx))
                except _Bad as bad:
                    raise bad.at(f"[{i}]") from None
            return out

        return conv_list
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        key, val = _converter(key_tp), _converter(val_tp, dtype, ndim)

        def conv_dict(value: Any, ctx: _Ctx) -> Any:
            if type(value) is not dict:
                raise _Bad(f"expected a map, got {_kind(value)}")
            out = {}
            for k, v in value.items():
                try:
                    kk = key(k, ctx)
                except _Bad as bad:
                    raise bad.at(".<key>") from None
                try:
                    out[kk] = val(v, ctx)
                except _Bad as bad:
                    raise bad.at(f"[{_short(k, 40)}]") from None
            return out

        return conv_dict
    if dataclasses.is_dataclass(tp):
        return _record_converter(tp)
    if tp is float:

        def conv_float(value: Any, ctx: _Ctx) -> Any:
            t = type(value)
            if t is float:
                return value
            if t is int:
                return float(value)
            raise _Bad(f"expected float, got {_kind(value)}")

        return conv_float
    if tp in (bool, int, str, bytes):
        name = tp.__name__

        def conv_exact(value: Any, ctx: _Ctx) -> Any:
            if type(value) is tp:  # exact: a bool is not an int
                return value
            raise _Bad(f"expected {name}, got {_kind(value)}")

        return conv_exact

    def unsupported(value: Any, ctx: _Ctx) -> Any:  # a schema bug, caught by tests
        raise _Bad(f"unsupported field type {tp!r}")

    return unsupported


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
