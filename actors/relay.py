"""An actor's chunk server: serves the weight chunks this actor has already verified to
other actors (the relay tree, ``learner.relay`` and docs/architecture.md "Weight fan-out").

Same wire as the learner's weights ROUTER (``learner/weights.py``): frames in are
``[identity, request_id, *WeightChunkRequest]``, frames out ``[identity, request_id,
*WeightChunk]`` (one message per chunk, its data its own frame) or ``[identity,
request_id, *ErrorReply]``.  A request for a run (``WeightChunkRequest.count``) gets one
message per chunk, in order: at once for the chunks already verified, then each as it is
verified, until the run is complete; so a pipelined child asks once per run and can
forward each chunk to its own children as soon as it has checked it.  A run whose next chunk
this relay does not hold (yet) is answered ``ErrorReply(code="not_yet",
retryable=True)`` after holding the request up to ``hold_s`` (answered the moment the
chunk is verified, so a pipelined child is one chunk behind its parent without polling):
its own pull may still be on the way, so the asker retries a little later, and after its patience runs out asks its next source (ultimately the learner).  A
version older than the newest this relay has begun to pull, and no longer held, will not
come: ``ErrorReply(code="unknown_version")`` sends the asker to its next source at once
(an actor skips versions when a newer one is announced before it pulls).

Safety (the receive buffers' ordering contract, ``actors/weight_path.py``):

- a buffer is registered (``begin``) for version v *before* a pull writes into it; any
  earlier registration of that buffer is withdrawn at that moment, under the lock the
  serving thread holds through each send, so no chunk of an older version is ever read
  from a buffer being overwritten;
- a chunk is served only after the pull has verified it against the manifest checksum
  (``mark``); the pull never writes a verified chunk again (late replies are dropped);
- sends copy the chunk into the ZeroMQ message under the lock (``copy=True``), so no
  reply references the buffer after the lock is released.

The asker verifies every chunk's checksum regardless of source (``actors/weight_sync.py``),
so a relay serving wrong bytes costs a re-fetch from elsewhere, never a wrong version.

``corrupt=True`` flips one byte of every chunk it serves (tests only: it is how the
checksum refusal is exercised end to end; ``actors.main`` sets it from
``TURNSCALE_TEST_RELAY_CORRUPT=1``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Hashable

import numpy as np
import zmq

from turnscale.protocol import codec
from turnscale.protocol.messages import ErrorReply, WeightChunkRequest, WeightManifest
from turnscale.protocol.weights import chunk_reply_frames
from turnscale.protocol.curve import AllowedKeys, ZapAuthenticator
from turnscale.protocol.router import read_request, serve_router
from turnscale.protocol.transport import CurveKeys, SocketLimits, configure

log = logging.getLogger(__name__)

HOLD_S = 1.0
"""Default hold of a request for a chunk not verified yet.  A child asks up to ``window``
runs ahead (4 x 1 MB by default, ``actors/weight_sync.py``); the farthest run's first chunk
reaches this relay that many bytes later, so the hold must cover ``window x run bytes /
link rate`` (1 s: links of 32 Mbit/s and up), else the child gets ``not_yet`` and its
window stalls on the retries (0.5 s cost ~170 ms per hop of a chain at 50 Mbit/s).  It
stays well under the child's ``relay_timeout_s`` (3 s), which takes a silent relay for
dead."""


@dataclass
class _Held:
    manifest: WeightManifest
    buf: np.ndarray
    verified: np.ndarray  # bool per chunk


class RelayServer:
    """Serves verified chunks of the versions held in registered receive buffers on a
    ROUTER bound at ``endpoint`` (port 0 picks a free one; see ``self.endpoint``)."""

    def __init__(self, endpoint: str, *, context: zmq.Context | None = None, limits: SocketLimits = SocketLimits(),
                 curve: CurveKeys | None = None, poll_ms: int = 100, corrupt: bool = False, hold_s: float = HOLD_S) -> None:
        self._own_ctx: zmq.Context | None = None
        self._auth: ZapAuthenticator | None = None
        self.clients: AllowedKeys | None = None
        """With CURVE: the client keys admitted (ZAP), set by ``allow_clients``; none until then."""
        if curve is not None:
            # ZAP is per context: the relay's own, so no other socket of the actor is affected
            self._ctx = self._own_ctx = zmq.Context()
            self.clients = AllowedKeys(log, "weight relay")
            self._auth = ZapAuthenticator(self._ctx, provider=self.clients)
        else:
            self._ctx = context or zmq.Context.instance()
        self._lock = threading.Lock()
        self._held: dict[Hashable, _Held] = {}
        self.hold_s = hold_s
        """A request for a chunk not verified yet is held this long (answered as soon as it is)
        before ``not_yet``: a pipelined child gets each chunk one hop after its parent does,
        without polling."""
        self._pending: list[tuple[float, list, WeightChunkRequest, int]] = []  # (deadline, prefix, request, next chunk): serving thread only
        self._wanted = False  # some request is held: mark() wakes the serving thread
        wake = f"inproc://relay-wake-{id(self):x}"
        self._wake_rx = self._ctx.socket(zmq.PULL)  # used by the serving thread only
        self._wake_rx.bind(wake)
        self._wake_tx = self._ctx.socket(zmq.PUSH)  # used by mark()'s caller (the puller's thread) only
        self._wake_tx.setsockopt(zmq.LINGER, 0)
        self._wake_tx.setsockopt(zmq.SNDHWM, 4)
        self._wake_tx.connect(wake)
        self._stop = threading.Event()
        self._poll_ms = poll_ms
        self.corrupt = corrupt
        self.served_chunks = 0
        self.served_bytes = 0
        self.not_yet = 0
        self.newest = -1
        """The newest version ``begin`` has seen."""
        self._sock = configure(self._ctx.socket(zmq.ROUTER), limits, curve, server=True)
        if endpoint.endswith(":0"):
            port = self._sock.bind_to_random_port(endpoint[: endpoint.rindex(":")])
            endpoint = f"{endpoint[: endpoint.rindex(':')]}:{port}"
        else:
            self._sock.bind(endpoint)
        self.endpoint = endpoint
        self.public_key = curve.public.decode() if curve is not None else ""
        """Advertised in ``Hello.relay_public_key``: CURVE clients need it to connect."""
        self._thread = threading.Thread(target=self._serve, name="relay-router", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ puller side
    def begin(self, key: Hashable, manifest: WeightManifest, buf: np.ndarray) -> None:
        """``buf`` (known as ``key``) is about to receive ``manifest``'s version: withdraw what
        it held and serve its chunks as they are ``mark``-ed."""
        with self._lock:
            self._held[key] = _Held(manifest, buf, np.zeros(len(manifest.chunks), dtype=bool))
            self.newest = max(self.newest, manifest.version)

    def mark(self, key: Hashable, index: int) -> None:
        """Chunk ``index`` of ``key``'s version is in its buffer and verified."""
        with self._lock:
            h = self._held.get(key)
            if h is not None:
                h.verified[index] = True
            wanted = self._wanted
        if wanted:
            try:
                self._wake_tx.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # a wake-up is already queued (or we are closing): the thread will look anyway

    def allow_clients(self, keys: list[str]) -> None:
        """The CURVE public keys allowed to pull (the learner's ``relay_clients``); every
        other CURVE client fails the handshake.  No effect on a plain relay."""
        if self.clients is not None:
            self.clients.set(keys)

    def withdraw(self, key: Hashable) -> None:
        with self._lock:
            self._held.pop(key, None)

    def holds(self) -> dict[Hashable, tuple[int, int]]:
        """key -> (version, verified chunks), for tests and metrics."""
        with self._lock:
            return {k: (h.manifest.version, int(h.verified.sum())) for k, h in self._held.items()}

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        for sock in (self._sock, self._wake_rx, self._wake_tx):
            if not sock.closed:
                sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        if self._own_ctx is not None:
            self._own_ctx.term()

    def __enter__(self) -> "RelayServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ serving thread
    def _serve(self) -> None:
        serve_router(self._sock, self._stop, self._answer, poll_ms=self._poll_ms, log=log, name="relay", wake=self._wake_rx,
                     tick=self._retry_pending, timeout_ms=self._next_deadline_ms)

    def _next_deadline_ms(self) -> int | None:
        """Milliseconds to the nearest held request's deadline (None: none held)."""
        if not self._pending:
            return None
        return int((min(d for d, _, _, _ in self._pending) - time.monotonic()) * 1000) + 1

    def _retry_pending(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        now = time.monotonic()
        for deadline, prefix, req, nxt in pending:
            self._reply(prefix, req, hold=deadline > now, deadline=deadline, nxt=nxt)
        with self._lock:
            self._wanted = bool(self._pending)

    def _answer(self, frames: list) -> None:
        got = read_request(self._sock, frames, WeightChunkRequest)
        if got is not None:
            prefix, req = got
            self._reply(prefix, req, hold=self.hold_s > 0, deadline=time.monotonic() + self.hold_s, nxt=req.index)

    def _reply(self, prefix: list, req: WeightChunkRequest, *, hold: bool, deadline: float, nxt: int) -> None:
        """Send the run's verified chunks from ``nxt`` on, if ``nxt`` is verified, and keep
        the rest of the run pending (each further reply carries what was verified since);
        else hold the request (until ``deadline``), or answer ``not_yet`` / ``unknown_version``
        for the chunks from ``nxt`` on."""
        with self._lock:  # held through the send: a buffer is never re-registered mid-send
            for h in self._held.values():
                if h.manifest.version == req.version and 0 <= nxt < len(h.verified) and h.verified[nxt]:
                    stop = min(req.index + req.count, len(h.verified))
                    end = nxt + 1
                    while end < stop and h.verified[end]:
                        end += 1
                    for j in range(nxt, end):  # a message per chunk (learner/weights.py says why)
                        frames = chunk_reply_frames(h.manifest, h.buf, j, j + 1, corrupt=self.corrupt)
                        self._sock.send_multipart([*prefix, *frames], copy=True)
                    self.served_chunks += end - nxt
                    self.served_bytes += sum(c.nbytes for c in h.manifest.chunks[nxt:end])
                    if end < stop:  # the rest of the run follows as it is verified
                        self._pending.append((time.monotonic() + self.hold_s, prefix, req, end))
                        self._wanted = True
                    return
            gone = req.version < self.newest and all(h.manifest.version != req.version for h in self._held.values())
            if hold and not gone:
                self._pending.append((deadline, prefix, req, nxt))
                self._wanted = True
                return
            self.not_yet += not gone
        if gone:
            err = ErrorReply(code="unknown_version", message=f"this relay holds no version {req.version} and never "
                             f"will (it has moved on to {self.newest}); ask the next source")
        else:
            err = ErrorReply(code="not_yet", retryable=True,
                             message=f"this relay does not hold chunk {nxt} of version {req.version} (yet)")
        self._sock.send_multipart([*prefix, *codec.encode(err)])
