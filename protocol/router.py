"""One ROUTER socket served on a plain thread: the loop the weight publisher (learner) and the
weight relay (actors) share.

``serve_router`` polls the socket until ``stop`` is set and hands each request's frames to
``answer`` on this thread (the only thread that touches the socket).  It never dies on one
request: a ``ZMQError`` other than the context's termination is logged and serving goes on;
any other exception from ``answer`` is logged the same way.  ``wake`` (a PULL socket another
thread pushes to) interrupts the poll early; ``tick`` runs after every poll (pending work
such as held requests whose deadline came); ``timeout_ms`` shortens the next poll (the
nearest such deadline).

``read_request`` decodes one request, answering a malformed one with ``ErrorReply
(bad_message)`` to the sender (when it can be addressed) and returning None.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, TypeVar

import zmq

from turnscale.protocol import codec
from turnscale.protocol.errors import ProtocolError
from turnscale.protocol.messages import ErrorReply
from turnscale.protocol.transport import split_router_frames

T = TypeVar("T")


def serve_router(sock: zmq.Socket, stop: threading.Event, answer: Callable[[list], None], *, poll_ms: int,
                 log: logging.Logger, name: str, wake: zmq.Socket | None = None, tick: Callable[[], None] | None = None,
                 timeout_ms: Callable[[], int | None] | None = None) -> None:
    """Serve ``sock`` on the calling thread until ``stop`` is set or the context terminates."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    if wake is not None:
        poller.register(wake, zmq.POLLIN)
    while not stop.is_set():
        try:
            timeout = poll_ms
            sooner = timeout_ms() if timeout_ms is not None else None
            if sooner is not None:
                timeout = max(0, min(timeout, sooner))
            ready = dict(poller.poll(timeout))
            if wake is not None and wake in ready:
                _drain(wake)
            if tick is not None:
                tick()
            if sock in ready:
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    answer(frames)
        except zmq.ZMQError as exc:
            if stop.is_set() or exc.errno == zmq.ETERM:
                return
            log.exception("%s ROUTER error; continuing", name)
        except Exception:  # never let the serving thread die on one bad request
            log.exception("%s ROUTER: unexpected error answering a request", name)


def _drain(sock: zmq.Socket) -> None:
    while True:
        try:
            sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return


def read_request(sock: zmq.Socket, frames: list, expect: type[T]) -> tuple[list, T] | None:
    """``(routing prefix, request)``; None after answering ``bad_message`` to a malformed one."""
    try:
        prefix, body = split_router_frames(frames)
        return prefix, codec.decode(body, expect=expect)
    except ProtocolError as exc:
        if len(frames) >= 2:
            sock.send_multipart([frames[0].bytes, frames[1].bytes, *codec.encode(
                ErrorReply(code="bad_message", message=f"expected a {expect.__name__}: {exc}"))])
        return None
