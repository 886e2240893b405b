"""The client's HTTP/1.1 codec: framing by length, chunks, close; keep-alive; bad input."""

from __future__ import annotations

import pytest

from turnscale.common.http11 import HTTPProtocolError, ResponseParser, build_request


def parse(*pieces: bytes, eof: bool = False) -> ResponseParser:
    p = ResponseParser()
    for piece in pieces:
        p.feed(piece)
    if eof:
        p.feed_eof()
    return p


def test_request_bytes():
    assert build_request("GET", "/health", "h:1", None) == b"GET /health HTTP/1.1\r\nHost: h:1\r\nAccept: application/json\r\n\r\n"
    req = build_request("POST", "/step", "h:1", b'{"id":1}')
    assert req.endswith(b"Content-Length: 8\r\n\r\n{\"id\":1}")
    with pytest.raises(ValueError):
        build_request("GET", "/a b", "h", None)


def test_content_length_body_split_across_reads():
    raw = b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\ncontent-type: application/json\r\n\r\n{\"a\": true}"
    p = ResponseParser()
    for i in range(len(raw)):
        assert p.result is None
        p.feed(raw[i : i + 1])
    assert p.result.status == 200 and p.result.body == b'{"a": true}' and p.result.keep_alive


def test_chunked_with_trailers_and_interim_response():
    p = parse(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nab", b"cd\r\n2;x=y\r\nef\r\n0\r\nX-T: 1\r\n\r\n")
    assert p.result.status == 404 and p.result.body == b"abcdef" and p.leftover == b""
    p = parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    assert p.result.body == b""


def test_close_framing_and_connection_close():
    p = parse(b"HTTP/1.0 200 OK\r\n\r\nhello", eof=True)
    assert p.result.body == b"hello" and not p.result.keep_alive
    p = parse(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
    assert p.result.body == b"" and not p.result.keep_alive


def test_malformed_responses_raise():
    for raw in (b"SMTP ready\r\n\r\n", b"HTTP/1.1 abc OK\r\n\r\n", b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"):
        with pytest.raises(HTTPProtocolError):
            parse(raw)
    with pytest.raises(HTTPProtocolError):
        parse(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", eof=True)
