"""ZeroMQ sockets for trio tasks and for plain threads, with limits set on every socket.

pyzmq has no trio integration.  ``AsyncSocket`` tries every operation with
``zmq.NOBLOCK``; only on ``zmq.Again`` does it await the socket's file descriptor.
That FD is edge-triggered and means only "``zmq.EVENTS`` may have changed", so:

1. ``EVENTS`` is re-read before every wait (reading it re-arms the edge);
2. only one trio task waits on the FD at a time; others park and are woken whenever
   any operation on the socket succeeds or the waiter returns;
3. every successful operation wakes the FD waiter (its wait is cancelled and it re-reads
   ``EVENTS``): libzmq may consume the FD's edge inside another task's send/recv;
4. every ``CHECKPOINT_EVERY`` fast-path operations the task yields, so a flood of
   ready messages cannot starve other tasks;
5. cancellation is checked before an operation, never after it succeeds: a cancelled
   send sent nothing and a cancelled receive took nothing off the socket; a multipart
   send is all-or-nothing (ZeroMQ queues the whole message or raises ``Again`` on the
   first frame), so cancellation never leaves half a message;
6. ``close()`` calls ``trio.lowlevel.notify_closing`` before closing the socket.

A socket belongs to one thread; ``AsyncSocket`` to one trio run.  Thread code uses
plain pyzmq sockets configured by ``configure``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import trio
import zmq

from turnscale.protocol import codec
from turnscale.protocol.errors import PeerTimeout, RemoteError, TooManyFrames, TransportError

CHECKPOINT_EVERY = 16
DRAIN_CHECKPOINT_FRAMES = 8192
"""While dropping the frames of a message over ``max_frames``, yield to other tasks this often."""


@dataclass(frozen=True, slots=True)
class SocketLimits:
    """Options applied to every socket."""

    max_message_bytes: int = 1 << 30
    """ZeroMQ ``MAXMSGSIZE``, which bounds each *frame*: a peer sending a larger frame is
    disconnected before Python sees it.  It does not bound a multipart message's total
    (three frames just under the limit arrive); ``codec.decode`` checks the total
    (``codec.Limits.max_message_bytes``) before decoding anything."""
    sndhwm: int = 1000
    """Outgoing queue bound, in messages."""
    rcvhwm: int = 1000
    """Incoming queue bound, in messages."""
    linger_ms: int = 0
    """Never rely on linger to flush (FACTS.md): replies are acknowledged instead."""


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """Optional CURVE keys (z85 text).  A server needs its secret key; a client needs the
    server's public key and a key pair of its own."""

    public: bytes
    secret: bytes
    server_public: bytes = b""


def generate_curve_keys() -> CurveKeys:
    public, secret = zmq.curve_keypair()
    return CurveKeys(public=public, secret=secret)


def configure(sock: zmq.Socket, limits: SocketLimits = SocketLimits(), curve: CurveKeys | None = None, *, server: bool = False) -> zmq.Socket:
    """Apply limits (and CURVE when given) to a new socket; returns it."""
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes)
    sock.setsockopt(zmq.SNDHWM, limits.sndhwm)
    sock.setsockopt(zmq.RCVHWM, limits.rcvhwm)
    sock.setsockopt(zmq.LINGER, limits.linger_ms)
    if curve is not None:
        if server:
            sock.curve_server = True
            sock.curve_secretkey = curve.secret
            sock.curve_publickey = curve.public
        else:
            if not curve.server_public:
                raise ValueError("CURVE client needs the server's public key (CurveKeys.server_public)")
            sock.curve_serverkey = curve.server_public
            sock.curve_secretkey = curve.secret
            sock.curve_publickey = curve.public
    return sock


class AsyncSocket:
    """A ZeroMQ socket usable from trio tasks (see the module docstring for the rules)."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self._fd = sock.getsockopt(zmq.FD)
        self._waiting = False
        self._wake: trio.CancelScope | None = None
        self._lot = trio.lowlevel.ParkingLot()
        self._fast_ops = 0
        self._closed = False
        self._draining = False
        """A receive is dropping the frames of a message over its limit (``_recv_rest``)."""

    async def _wait(self, flag: int) -> None:
        while True:
            if self._closed:
                raise TransportError("socket closed")
            if self.sock.getsockopt(zmq.EVENTS) & flag:
                return
            if self._waiting:
                await self._lot.park()
                continue
            self._waiting = True
            try:
                with trio.CancelScope() as self._wake:
                    await trio.lowlevel.wait_readable(self._fd)
            except trio.ClosedResourceError:
                raise TransportError("socket closed") from None
            finally:
                self._waiting = False
                self._wake = None
                self._lot.unpark_all()

    async def _after_success(self) -> None:
        # A successful operation may have consumed the FD's edge (libzmq processes its
        # command mailbox inside send/recv), so whoever waits on the FD must re-read
        # EVENTS: wake the FD waiter and every parked task.
        if self._wake is not None:
            self._wake.cancel()
        self._lot.unpark_all()
        self._fast_ops += 1
        if self._fast_ops % CHECKPOINT_EVERY == 0:
            # Schedule point only: the operation has happened, so it must not be undone
            # by a Cancelled raised after it (trio: a cancelled operation did not happen).
            await trio.lowlevel.cancel_shielded_checkpoint()

    async def send_multipart(self, frames: Sequence[Any], copy: bool = False) -> None:
        """Send one multipart message, all or nothing; if cancelled, nothing was sent."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            if self._closed:
                raise TransportError("socket closed")
            try:
                self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
            except zmq.Again:
                await self._wait(zmq.POLLOUT)
                continue
            except zmq.ZMQError as exc:
                raise TransportError(f"send failed: {exc}") from exc
            await self._after_success()
            return

    async def recv_multipart(self, copy: bool = False, max_frames: int | None = None) -> list[Any]:
        """Receive one multipart message; if cancelled, nothing was taken off the socket.

        With ``max_frames``, a message of more frames is taken off the socket whole (ZeroMQ
        delivers messages atomically: the rest cannot be left behind) but its frames past
        the limit are dropped as they arrive, never kept or decoded, and ``TooManyFrames``
        is raised carrying the first frames (a ROUTER's routing frames, to reply to).
        Dropping costs ~0.5 us per frame; every ``DRAIN_CHECKPOINT_FRAMES`` the task
        yields (shielded: the message is taken whole) so other tasks run meanwhile."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            if self._closed:
                raise TransportError("socket closed")
            if self._draining:
                await self._lot.park()
                continue
            try:
                if max_frames is None:
                    frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=copy)
                else:
                    first = self.sock.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                await self._wait(zmq.POLLIN)
                continue
            except zmq.ZMQError as exc:
                raise TransportError(f"recv failed: {exc}") from exc
            if max_frames is not None:
                frames = await self._recv_rest(first, copy, max_frames)
            await self._after_success()
            return frames

    async def _recv_rest(self, first: zmq.Frame, copy: bool, max_frames: int) -> list[Any]:
        """The frames of the message whose first frame is ``first``, at most ``max_frames``
        of them kept (see ``recv_multipart``)."""
        frames: list[Any] = [first]
        more = first.more
        recv = self.sock.recv
        count = 1
        try:
            while more and count < max_frames:
                frame = recv(zmq.NOBLOCK, copy=False)  # the message is complete: never Again
                frames.append(frame)
                more = frame.more
                count += 1
            if more:
                self._draining = True  # other receivers wait: the rest of this message is ours
                while more:  # over the limit: count and drop the rest as it is read
                    more = recv(zmq.NOBLOCK, copy=False).more
                    count += 1
                    if count % DRAIN_CHECKPOINT_FRAMES == 0:
                        await trio.lowlevel.cancel_shielded_checkpoint()
        except zmq.ZMQError as exc:
            raise TransportError(f"recv failed: {exc}") from exc
        finally:
            if self._draining:
                self._draining = False
                self._lot.unpark_all()
        if count > max_frames:
            head = [f.bytes for f in frames[:TooManyFrames.HEAD_FRAMES]]
            del frames
            raise TooManyFrames(f"message has {count} frames, over the limit of {max_frames}", head, count)
        return frames if not copy else [f.bytes for f in frames]

    async def send_msg(self, msg: Any, prefix: Sequence[bytes] = ()) -> None:
        """Encode and send a record, after optional routing frames (ROUTER identities)."""
        await self.send_multipart([*prefix, *codec.encode(msg)])

    async def recv_msg(self, limits: codec.Limits = codec.DEFAULT_LIMITS, expect: Any = None) -> Any:
        """Receive and decode one record (raises ``ProtocolError`` on a bad one)."""
        frames = await self.recv_multipart()
        return codec.decode(frames, limits, expect=expect)

    def close(self, linger: int = 0) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            trio.lowlevel.notify_closing(self._fd)
        except RuntimeError:
            pass  # not inside trio (cleanup after the run ended)
        self._lot.unpark_all()
        self.sock.close(linger=linger)

    async def __aenter__(self) -> AsyncSocket:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class Requester:
    """Request/response over one DEALER socket from trio, with a timeout per request.

    One request is in flight at a time (a trio lock); a reply that arrives after its
    request timed out is recognised by its request id frame and discarded, so replies
    never get out of step with requests.
    """

    def __init__(self, sock: AsyncSocket, limits: codec.Limits = codec.DEFAULT_LIMITS) -> None:
        self.sock = sock
        self.limits = limits
        self._lock = trio.Lock()
        self._next_id = 0

    async def request(self, msg: Any, *, timeout_s: float, expect: Any = None) -> Any:
        """Send ``msg`` and return the decoded reply.

        Raises ``PeerTimeout`` when no reply (or no room to send) within ``timeout_s``,
        ``RemoteError`` when the peer answers with an ``ErrorReply``, and ``ProtocolError``
        when the reply is malformed or not of an ``expect`` type.
        """
        from turnscale.protocol.messages import ErrorReply

        async with self._lock:
            self._next_id += 1
            rid = self._next_id.to_bytes(8, "little")
            frames = codec.encode(msg)
            with trio.move_on_after(timeout_s) as scope:
                await self.sock.send_multipart([rid, *frames])
                while True:
                    reply = await self.sock.recv_multipart()
                    if reply and _buf(reply[0]) == rid:
                        break  # else: a late reply to an earlier, timed-out request
            if scope.cancelled_caught:
                raise PeerTimeout(f"no reply to {type(msg).__name__} within {timeout_s:.1f}s")
            want = None if expect is None else (*(expect if isinstance(expect, tuple) else (expect,)), ErrorReply)
            out = codec.decode(reply[1:], self.limits, expect=want)
            if isinstance(out, ErrorReply):
                raise RemoteError(out.code, out.message, out.retryable)
            return out


def _buf(frame: Any) -> bytes:
    return frame.bytes if hasattr(frame, "bytes") else bytes(frame)


def split_router_frames(frames: list[Any]) -> tuple[list[bytes], list[Any]]:
    """ROUTER side: ``[identity, request_id, *message]`` -> (reply prefix, message frames).

    The reply prefix is ``[identity, request_id]``; send it back in front of the reply.
    Raises ``ProtocolError`` when the routing frames are missing.
    """
    from turnscale.protocol.errors import ProtocolError

    if len(frames) < 3:
        raise ProtocolError(f"expected [identity, request id, message...], got {len(frames)} frame(s)")
    return [_buf(frames[0]), _buf(frames[1])], frames[2:]


def tcp_endpoint(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


_EPHEMERAL_DEFAULT = (32768, 60999)
_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for tests and the one-machine launcher).

    Chosen at random *outside* the kernel's ephemeral range and never twice in one process:
    a port the kernel picked for ``bind(0)`` is in the range it also draws outgoing
    connections' source ports from, so another process's connection could take it before
    the caller binds it (seen on a loaded CI machine: a learner failed with "Address already
    in use").  Falls back to ``bind(0)`` if no port outside the range is free."""
    import random
    import socket

    lo, hi = _ephemeral_range()
    spans = [(r0, r1) for r0, r1 in ((20000, lo - 1), (hi + 1, 65535)) if r1 - r0 >= 1000]
    for _ in range(200 if spans else 0):
        r0, r1 = random.choice(spans)
        port = random.randint(r0, r1)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def actor_identity() -> bytes:
    """A fresh ZeroMQ routing identity (stable across one connection only)."""
    return os.urandom(8)
