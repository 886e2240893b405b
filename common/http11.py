"""A small HTTP/1.1 client codec (pure, no I/O): request bytes out, response bytes in.

Why not ``h11``: the env client sends thousands of tiny JSON requests per second from one
trio thread, and h11's general state machine cost about a quarter of the client's CPU.
This codec covers what env servers answer: a status line, headers, and a body framed by
``Content-Length``, ``Transfer-Encoding: chunked`` or the connection's close; 1xx interim
responses are skipped.  Anything else malformed raises ``HTTPProtocolError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_HEAD_BYTES = 64 * 1024


class HTTPProtocolError(Exception):
    """The peer's bytes are not a valid HTTP/1.1 response."""


def build_request(method: str, target: str, host: str, body: bytes | None) -> bytes:
    """``method target HTTP/1.1`` with Host, Accept and (with a body) JSON content headers."""
    if any(c in target for c in " \r\n") or any(c in host for c in " \r\n"):
        raise ValueError(f"invalid request target or host: {target!r} {host!r}")
    head = f"{method} {target} HTTP/1.1\r\nHost: {host}\r\nAccept: application/json\r\n"
    if body is None:
        return (head + "\r\n").encode("ascii")
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode("ascii") + body


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes
    keep_alive: bool


@dataclass
class ResponseParser:
    """Feed bytes with ``feed``; ``result`` is set once one whole response has arrived.
    ``leftover`` holds bytes after it (a well-behaved server sends none)."""

    max_body: int = 64 << 20
    buf: bytearray = field(default_factory=bytearray)
    result: Response | None = None
    leftover: bytes = b""
    _head: tuple[int, dict[str, str], bool] | None = None

    def feed(self, data: bytes) -> None:
        self.buf += data
        self._advance(eof=False)

    def feed_eof(self) -> None:
        """The peer closed the connection; completes a read-until-close body, else raises."""
        self._advance(eof=True)
        if self.result is None:
            raise HTTPProtocolError("connection closed before the response was complete")

    def _advance(self, eof: bool) -> None:
        while self.result is None:
            if self._head is None:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(self.buf) > MAX_HEAD_BYTES:
                        raise HTTPProtocolError("response head too large")
                    return
                head = bytes(self.buf[:end])
                del self.buf[: end + 4]
                status, headers, version11 = _parse_head(head)
                if 100 <= status < 200:
                    continue  # interim response: the real one follows
                self._head = (status, headers, version11)
            if not self._body(eof):
                return

    def _body(self, eof: bool) -> bool:
        status, headers, version11 = self._head  # type: ignore[misc]
        conn = headers.get("connection", "").lower()
        keep = ("close" not in conn) if version11 else ("keep-alive" in conn)
        if status in (204, 304):
            return self._finish(b"", 0, keep)
        if "chunked" in headers.get("transfer-encoding", "").lower():
            return self._chunked(keep)
        if "content-length" in headers:
            try:
                n = int(headers["content-length"])
            except ValueError:
                raise HTTPProtocolError("bad Content-Length") from None
            if n < 0 or n > self.max_body:
                raise HTTPProtocolError(f"Content-Length {n} out of range")
            if len(self.buf) < n:
                return False
            return self._finish(bytes(self.buf[:n]), n, keep)
        if not eof:  # body until the server closes
            if len(self.buf) > self.max_body:
                raise HTTPProtocolError("response body too large")
            return False
        return self._finish(bytes(self.buf), len(self.buf), False)

    def _chunked(self, keep: bool) -> bool:
        pos, parts, size = 0, [], 0
        while True:
            eol = self.buf.find(b"\r\n", pos)
            if eol < 0:
                return False
            try:
                n = int(bytes(self.buf[pos:eol]).split(b";")[0].strip(), 16)
            except ValueError:
                raise HTTPProtocolError("bad chunk size") from None
            start = eol + 2
            if n == 0:  # last chunk; optional trailers end with an empty line
                if len(self.buf) < start + 2:
                    return False
                if self.buf[start : start + 2] == b"\r\n":
                    consumed = start + 2
                else:
                    end = self.buf.find(b"\r\n\r\n", start)
                    if end < 0:
                        return False
                    consumed = end + 4
                self.result = Response(self._head[0], self._head[1], b"".join(parts), keep)  # type: ignore[index]
                self.leftover = bytes(self.buf[consumed:])
                del self.buf[:]
                return True
            if len(self.buf) < start + n + 2:
                return False
            size += n
            if size > self.max_body:
                raise HTTPProtocolError("response body too large")
            parts.append(bytes(self.buf[start : start + n]))
            pos = start + n + 2

    def _finish(self, body: bytes, consumed: int, keep: bool) -> bool:
        self.result = Response(self._head[0], self._head[1], body, keep)  # type: ignore[index]
        self.leftover = bytes(self.buf[consumed:])
        del self.buf[:]
        return True


def _parse_head(head: bytes) -> tuple[int, dict[str, str], bool]:
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise HTTPProtocolError(f"bad status line {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            raise HTTPProtocolError(f"bad header line {line[:80]!r}")
        headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    return int(parts[1]), headers, parts[0] == b"HTTP/1.1"
