"""Request bodies in, JSON responses out, within the server's limits (``env.limits``).

Reading (``read_json_object``), in this order, each failure an ``ApiError`` that says what
was wrong:
1. a ``Content-Length`` above ``max_body_bytes`` is refused before one body byte is read
   (413);
2. the body is counted while it streams: the first chunk past the limit stops the read (413);
   the rest of a refused body is discarded, not stored, for at most ``LINGER_S``
   (``envhub.httpserver``), so a client that writes its whole body before reading still
   gets the 413 instead of a connection reset;
3. the whole body must arrive within ``body_timeout_s`` of the headers (408, connection
   closed);
4. before it is decoded, its shape is measured on the raw bytes (``json_shape``: a few
   C-speed passes, linear in the body's size, no Python loop over its values): nesting no
   deeper than ``max_json_depth`` (422 ``too_deep``) and at most ``max_json_values`` values
   (422 ``too_many_values``), so decoding and checking a body costs the event loop a few
   milliseconds at most, whatever a client packs into ``max_body_bytes`` (a 1 MiB array of
   520k numbers once cost 0.9 s: 0.74 s of it walking the decoded values);
5. it must be UTF-8 JSON (422 ``invalid_json``), an object, and every string in it must be
   encodable as UTF-8 (422 ``invalid_text``: a lone surrogate such as ``"\\ud800"`` is
   refused at the door, before any env sees it).

Writing (``encode_json``): UTF-8 JSON; should a string that cannot be UTF-8 encoded ever
reach a response, it is sent ``\\u``-escaped instead of failing, so any string the server
holds can be returned.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np

from starlette.requests import Request

from turnscale.conf.schema import ServerLimits
from turnscale.envhub.instances import ApiError


async def read_body(request: Request, limits: ServerLimits) -> bytes:
    """The raw body, enforcing the size limit while reading and the body deadline."""
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, "body_too_large", f"request body is {int(declared)} bytes (Content-Length); the limit is {limit} (env.limits.max_body_bytes)")
    buf = bytearray()
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in request.stream():
                buf += chunk
                if len(buf) > limit:
                    raise ApiError(413, "body_too_large", f"request body exceeds the limit of {limit} bytes (env.limits.max_body_bytes)")
    except TimeoutError:
        raise ApiError(408, "body_timeout", f"the request body did not arrive within {limits.body_timeout_s:g} s (env.limits.body_timeout_s); "
                       f"got {len(buf)} bytes", close_connection=True) from None
    return bytes(buf)


def parse_json_object(raw: bytes, limits: ServerLimits, *, required: bool = True) -> dict[str, Any]:
    """``raw`` as a JSON object within the depth and text rules above; ``{}`` for an empty
    body when not ``required``."""
    if not raw.strip():
        if required:
            raise ApiError(422, "invalid_body", "request body is empty; send a JSON object")
        return {}
    check_shape(raw, limits)
    try:
        data = json.loads(raw)
    except RecursionError:
        raise ApiError(422, "too_deep", f"request body nests arrays/objects deeper than {limits.max_json_depth} levels (env.limits.max_json_depth)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(422, "invalid_json", f"request body is not valid JSON ({exc.__class__.__name__}: {str(exc)[:120]})") from None
    if not isinstance(data, dict):
        raise ApiError(422, "invalid_body", f"request body must be a JSON object, got {type(data).__name__}")
    check_values(data, limits.max_json_depth)
    return data


_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
"""Every byte but JSON's brackets (deleted by ``bytes.translate``)."""
_DEPTH_STEP = np.zeros(256, np.int32)
_DEPTH_STEP[list(b"[{")] = 1
_DEPTH_STEP[list(b"]}")] = -1


def json_shape(raw: bytes, max_values: int) -> tuple[int, int]:
    """``(depth, values)`` of the JSON text ``raw`` without decoding it: linear in its size,
    each pass in C (about 1 ms per MiB, 6 ms for a MiB of brackets).  ``values`` is an upper
    bound (items, members and containers: commas + containers + 1), exact up to the
    containers, and counts nothing inside strings; ``depth`` is exact.  Past ``4 *
    max_values`` quotes (at most two strings per value: a key and a value) the body has more
    than ``max_values`` values: ``(0, quotes // 4)`` without the rest.  For text that is not
    valid JSON both are only indicative: the decoder refuses it afterwards."""
    text = raw.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in raw else raw  # left: no escaped quote
    quotes = text.count(b'"')
    if quotes > 4 * max_values:
        return 0, quotes // 4
    outside = b"".join(text.split(b'"')[0::2]) if quotes else text  # drop every string's content
    opens = outside.count(b"[") + outside.count(b"{")
    values = outside.count(b",") + opens + 1
    if opens <= 1:
        return opens, values
    brackets = np.frombuffer(outside.translate(None, _NOT_BRACKETS), np.uint8)
    return int(np.cumsum(_DEPTH_STEP[brackets]).max()), values


def check_shape(raw: bytes, limits: ServerLimits) -> None:
    """422 ``too_deep`` / ``too_many_values`` for a body past ``max_json_depth`` /
    ``max_json_values`` (``json_shape``), before anything decodes it."""
    depth, values = json_shape(raw, limits.max_json_values)
    if depth > limits.max_json_depth:
        raise ApiError(422, "too_deep", f"request body nests arrays/objects {depth} levels deep; the limit is {limits.max_json_depth} (env.limits.max_json_depth)")
    if values > limits.max_json_values:
        raise ApiError(422, "too_many_values", f"request body holds about {values} JSON values (items, members, containers); the limit is "
                       f"{limits.max_json_values} (env.limits.max_json_values): every route takes a few fields, /v1/step_batch at most "
                       "256 steps")


def check_values(data: Any, max_depth: int) -> None:
    """Iterative walk: nesting depth at most ``max_depth``; every string (keys too) UTF-8 encodable."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > max_depth:
                raise ApiError(422, "too_deep", f"request body nests arrays/objects deeper than {max_depth} levels (env.limits.max_json_depth)")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    _check_text(key)
                stack.append((item, depth + 1))
        elif isinstance(value, str):
            _check_text(value)


def _check_text(s: str) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = s[exc.start]
        raise ApiError(422, "invalid_text", f"a string in the request body holds the lone surrogate U+{ord(bad):04X} at character {exc.start}, "
                       "which is not Unicode text; send valid UTF-8 (pair surrogates, or drop them)") from None


def encode_json(data: Any) -> bytes:
    """Compact UTF-8 JSON; strings that cannot be UTF-8 encoded are ``\\u``-escaped."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), default=str)
    try:
        return text.encode()
    except UnicodeEncodeError:
        return json.dumps(data, ensure_ascii=True, separators=(",", ":"), default=str).encode()
