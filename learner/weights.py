"""Weight publication: the learner's weights ROUTER, served by its own thread.

The learner's end of the weight-transfer protocol (``protocol/weights.py``; the actor's
end is ``actors/weight_sync.py``).  ``publish(version, state_dict)`` lays every tensor end
to end (in the order given, each at an offset aligned to its element size) into one byte
buffer, casting floating tensors to the transfer dtype on the way, cuts the stream into
chunks of ``chunk_mb``, checksums each
(``protocol.checksums``: crc32c in hardware, as fast as a memory copy; zlib's crc32 ran
at a third of memcpy speed on the loaded 2-core box and dominated a pull) and returns the ``WeightManifest`` the service announces on PUB.  The latest
``keep`` versions stay servable; older ones answer ``ErrorReply(code="unknown_version")``
(the oldest is retired when the next publication starts).

The serving thread answers ``WeightChunkRequest`` on the ROUTER: frames in are
``[identity, request_id, *WeightChunkRequest]`` (``protocol.transport.split_router_frames``),
frames out are ``[identity, request_id, *WeightChunk]`` with the chunk bytes sent
zero-copy from the version's buffer.  Control traffic never waits on it: it is a separate
socket in a separate thread, and ``publish`` only takes a lock to swap the version table.

Ordering: a version's buffer is complete and checksummed before it becomes visible to the
server thread.  Buffers are reused (allocating and first-touching a fresh one each time
is ~3x slower): before a retired buffer is overwritten, every zero-copy send from it has
been handed to the kernel (ZeroMQ ``MessageTracker``); if that takes more than a second a
new buffer is allocated instead.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import torch
import zmq

from protocol import checksums, codec
from protocol.dtypes import torch_dtype
from protocol.messages import ErrorReply, WeightChunk, WeightChunkRequest, WeightManifest
from protocol.router import read_request, serve_router
from protocol.transport import CurveKeys, SocketLimits, configure
from protocol.weights import build_manifest, layout, write_tensors

log = logging.getLogger(__name__)


@dataclass
class _Version:
    manifest: WeightManifest
    buf: np.ndarray
    trackers: list = field(default_factory=list)


class WeightPublisher:
    """Serves the latest ``keep`` weight versions on a ROUTER bound at ``endpoint``
    (``tcp://127.0.0.1:5557``; port 0 picks a free one, see ``self.endpoint``)."""

    def __init__(self, endpoint: str, *, chunk_mb: float = 32.0, dtype: str = "bfloat16", keep: int = 2,
                 context: zmq.Context | None = None, limits: SocketLimits = SocketLimits(), poll_ms: int = 100,
                 checksum_algo: str | None = None, curve: CurveKeys | None = None) -> None:
        if chunk_mb <= 0:
            raise ValueError(f"chunk_mb must be > 0, got {chunk_mb}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        torch_dtype(dtype)
        self.checksum_algo = checksum_algo or checksums.preferred()
        checksums.checksum(self.checksum_algo, b"")  # fail now if this process cannot compute it
        self.chunk_bytes = max(int(chunk_mb * (1 << 20)), 1)
        self.dtype = dtype
        self.keep = keep
        self._ctx = context or zmq.Context.instance()
        self._lock = threading.Lock()
        self._versions: dict[int, _Version] = {}
        self._spare: list[tuple[np.ndarray, list]] = []
        """Retired buffers and the trackers of their zero-copy sends."""
        self._stop = threading.Event()
        self._poll_ms = poll_ms
        self.served_chunks = 0
        self.served_bytes = 0
        """Learner egress: chunk bytes handed to the kernel for sending, all versions."""
        self.bad_requests = 0
        self._sock = configure(self._ctx.socket(zmq.ROUTER), limits, curve, server=True)  # CURVE: ZAP runs on context
        if endpoint.endswith(":0"):
            port = self._sock.bind_to_random_port(endpoint[: endpoint.rindex(":")])
            endpoint = f"{endpoint[: endpoint.rindex(':')]}:{port}"
        else:
            self._sock.bind(endpoint)
        self.endpoint = endpoint
        self._thread = threading.Thread(target=self._serve, name="weights-router", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ learner side

    def publish(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> WeightManifest:
        """Lay out, cast, chunk and checksum ``state_dict`` as ``version`` and make it
        servable.  The oldest versions are retired first so that, with this one, at most
        ``keep`` remain (its buffer is reused: ``keep`` buffers in all, not ``keep + 1``).
        Tensors may live on any device."""
        infos, total = layout(state_dict, self.dtype)
        with self._lock:  # make room first, so the oldest version's buffer can be reused
            for v in sorted(self._versions)[: max(len(self._versions) - (self.keep - 1), 0)]:
                old = self._versions.pop(v)
                self._spare.append((old.buf, old.trackers))
        buf = self._take_buffer(total)
        write_tensors(buf, infos, state_dict.values())
        manifest = build_manifest(version, self.dtype, buf, infos, total, chunk_bytes=self.chunk_bytes,
                                  checksum_algo=self.checksum_algo)
        with self._lock:
            self._versions[version] = _Version(manifest, buf)
        return manifest

    def retire(self, version: int) -> None:
        """Stop serving ``version`` now (its buffer becomes reusable); unknown versions are ignored."""
        with self._lock:
            old = self._versions.pop(version, None)
            if old is not None:
                self._spare.append((old.buf, old.trackers))

    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._versions)

    def close(self) -> None:
        """Stop the serving thread and close the socket (idempotent)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        if not self._sock.closed:
            self._sock.close(linger=0)

    def __enter__(self) -> "WeightPublisher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _take_buffer(self, total: int) -> np.ndarray:
        """A retired buffer of exactly ``total`` bytes whose zero-copy sends are done, else a new one."""
        with self._lock:
            self._spare = [(b, t) for b, t in self._spare if b.nbytes == total]  # sizes changed: drop the others
            spare = list(self._spare)
        for buf, trackers in spare:
            try:
                for t in trackers:
                    if not t.done:
                        t.wait(1.0)
            except zmq.NotDone:
                continue
            with self._lock:
                self._spare = [(b, t) for b, t in self._spare if b is not buf]
            return buf
        return np.empty(total, dtype=np.uint8)

    # ------------------------------------------------------------------ serving thread

    def _serve(self) -> None:
        serve_router(self._sock, self._stop, self._answer, poll_ms=self._poll_ms, log=log, name="weights")

    def _answer(self, frames: list) -> None:
        got = read_request(self._sock, frames, WeightChunkRequest)
        if got is None:
            self.bad_requests += 1
            return
        prefix, req = got
        with self._lock:  # held through the send: a buffer is never retired mid-send
            ver = self._versions.get(req.version)
            if ver is None:
                known = sorted(self._versions)
                err = ErrorReply(code="unknown_version",
                                 message=f"version {req.version} is not served (have {known}); pull the latest announced version")
            elif not 0 <= req.index < len(ver.manifest.chunks):
                err = ErrorReply(code="unknown_chunk",
                                 message=f"version {req.version} has chunks 0..{len(ver.manifest.chunks) - 1}, not {req.index}")
            else:
                c = ver.manifest.chunks[req.index]
                msg = WeightChunk(version=req.version, index=c.index, checksum=c.checksum, data=ver.buf[c.offset:c.offset + c.nbytes])
                frames = codec.encode(msg, out_of_band_bytes=0)  # data always its own frame: the actor recv_into's it
                tracker = self._sock.send_multipart([*prefix, *frames], copy=False, track=True)
                ver.trackers[:] = [t for t in ver.trackers if not t.done]
                ver.trackers.append(tracker)
                self.served_chunks += 1
                self.served_bytes += c.nbytes
                return
        self._sock.send_multipart([*prefix, *codec.encode(err)])
