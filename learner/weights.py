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
frames out are ``[identity, request_id, *WeightChunk]``, one message per chunk of the
request's run (``WeightChunkRequest.count``), in order, with the chunk bytes sent zero-copy
from the version's buffer.  One message per chunk, not one per run: ZeroMQ hands a message
over only whole, so an actor that relays the chunks onward (``actors/relay.py``) can verify
and forward chunk ``i`` while ``i + 1`` is still on the wire; with a run in one message
every hop of a relay chain waited for the whole run (stop 27: 170 ms per hop for 1 MB runs
at 50 Mbit/s).  Control traffic never waits on it: it is a separate
socket in a separate thread, and ``publish`` only takes a lock to swap the version table.

Same host (``shm=True``, ``learner.weights_shm``): every version's buffer is a shared-memory
segment (``protocol/shmweights.py``, a memfd) and ``segment_ref(version)`` names it for the
announcement; actors on this host copy the chunks from it instead of pulling them over TCP
(same manifest, same checksums).  A segment is rewritten only under its exclusive lock,
taken without waiting: one that a same-host reader holds is skipped and another one used
(at most ``keep + 2`` spares are kept; the rest are closed, their readers keep their pages
until they let go).  It is marked as being written (``Segment.begin_write``) before a byte
changes and gets its new version only once the stream is complete and checksummed
(``end_write``), so a reader never accepts a version that is gone.  Segments are memfds: nothing is left behind in ``/dev/shm``
whatever way the learner exits.

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

from turnscale.protocol import checksums, codec
from turnscale.protocol.dtypes import torch_dtype
from turnscale.protocol.messages import ErrorReply, WeightChunkRequest, WeightManifest
from turnscale.protocol.router import read_request, serve_router
from turnscale.protocol.shmweights import Segment, SegmentRef
from turnscale.protocol.transport import CurveKeys, SocketLimits, configure
from turnscale.protocol.weights import build_manifest, chunk_reply_frames, layout, write_and_chunk

log = logging.getLogger(__name__)


@dataclass
class _Version:
    manifest: WeightManifest
    buf: np.ndarray
    trackers: list = field(default_factory=list)
    segment: Segment | None = None
    served_bytes: int = 0
    """Chunk bytes of this version handed to the kernel for sending (its learner egress)."""


class WeightPublisher:
    """Serves the latest ``keep`` weight versions on a ROUTER bound at ``endpoint``
    (``tcp://127.0.0.1:5557``; port 0 picks a free one, see ``self.endpoint``)."""

    def __init__(self, endpoint: str, *, chunk_mb: float = 32.0, dtype: str = "bfloat16", keep: int = 2,
                 context: zmq.Context | None = None, limits: SocketLimits = SocketLimits(), poll_ms: int = 100,
                 checksum_algo: str | None = None, curve: CurveKeys | None = None, shm: bool = False) -> None:
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
        self.shm = shm
        self._spare: list[tuple[np.ndarray, list, Segment | None]] = []
        """Retired buffers, the trackers of their zero-copy sends, their segments (``shm``)."""
        self._stop = threading.Event()
        self._poll_ms = poll_ms
        self.served_chunks = 0
        self.served_bytes = 0
        """Learner egress: chunk bytes handed to the kernel for sending, all versions."""
        self._retired_egress: list[tuple[int, int, int]] = []
        """``(version, served bytes, total bytes)`` of retired versions not yet taken."""
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
                self._spare.append((old.buf, old.trackers, old.segment))
                self._retired_egress.append((v, old.served_bytes, old.manifest.total_bytes))
        buf, seg = self._take_buffer(total)
        if seg is not None:
            seg.begin_write()  # same-host readers refuse every chunk from here on
        try:
            chunks = write_and_chunk(buf, infos, state_dict.values(), total, self.chunk_bytes, self.checksum_algo)
            manifest = build_manifest(version, self.dtype, buf, infos, total, chunk_bytes=self.chunk_bytes,
                                      checksum_algo=self.checksum_algo, chunks=chunks)
        except BaseException:
            with self._lock:  # the buffer stays reusable; a segment stays marked as being written
                self._spare.append((buf, [], seg))
            if seg is not None:
                seg.unlock()
            raise
        if seg is not None:
            seg.end_write(version)
            seg.unlock()
        with self._lock:
            self._versions[version] = _Version(manifest, buf, segment=seg)
        return manifest

    def take_retired_egress(self) -> list[tuple[int, int, int]]:
        """``(version, served bytes, total bytes)`` of each version retired since the last
        call, oldest first.  A retired version can no longer be pulled, so its count is final:
        a late pull of an old version counts for that version, whenever its bytes leave."""
        with self._lock:
            taken, self._retired_egress = self._retired_egress, []
        return taken

    def segment_ref(self, version: int) -> SegmentRef | None:
        """Where a same-host actor finds ``version``'s stream (None: not served, or no ``shm``)."""
        with self._lock:
            ver = self._versions.get(version)
            return ver.segment.ref if ver is not None and ver.segment is not None else None

    def retire(self, version: int) -> None:
        """Stop serving ``version`` now (its buffer becomes reusable); unknown versions are ignored."""
        with self._lock:
            old = self._versions.pop(version, None)
            if old is not None:
                self._spare.append((old.buf, old.trackers, old.segment))

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
        with self._lock:
            segments = [v.segment for v in self._versions.values()] + [s for _, _, s in self._spare]
            self._versions.clear()
            self._spare.clear()
        for seg in segments:
            if seg is not None:
                seg.close()

    def __enter__(self) -> "WeightPublisher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _take_buffer(self, total: int) -> tuple[np.ndarray, Segment | None]:
        """A retired buffer of exactly ``total`` bytes whose zero-copy sends are done, else a
        new one; with ``shm`` each buffer is the stream of its own segment."""
        with self._lock:
            dropped = [s for b, _, s in self._spare if b.nbytes != total and s is not None]
            self._spare = [x for x in self._spare if x[0].nbytes == total]  # sizes changed: drop the others
            spare = list(self._spare)
        for seg in dropped:
            seg.close()
        for buf, trackers, seg in spare:
            if seg is not None and not seg.try_lock():  # a same-host reader holds it: leave it be
                continue
            try:
                for t in trackers:
                    if not t.done:
                        t.wait(1.0)
            except zmq.NotDone:
                if seg is not None:
                    seg.unlock()
                continue
            with self._lock:
                self._spare = [x for x in self._spare if x[0] is not buf]
            return buf, seg
        if self.shm:
            with self._lock:  # spares beyond keep + 2 (all held by readers) are let go: readers keep their pages
                extra = [x for x in self._spare if x[2] is not None][: max(len(self._spare) - (self.keep + 2), 0)]
                self._spare = [x for x in self._spare if all(x is not e for e in extra)]
            for _, _, old in extra:
                old.close()
            seg = Segment(total)
            seg.try_lock()
            return seg.stream[:total], seg
        return np.empty(total, dtype=np.uint8), None

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
                end = min(req.index + req.count, len(ver.manifest.chunks))
                ver.trackers[:] = [t for t in ver.trackers if not t.done]
                for i in range(req.index, end):  # a message per chunk: the asker can forward each as it lands
                    frames = chunk_reply_frames(ver.manifest, ver.buf, i, i + 1)
                    ver.trackers.append(self._sock.send_multipart([*prefix, *frames], copy=False, track=True))
                nbytes = sum(c.nbytes for c in ver.manifest.chunks[req.index:end])
                self.served_chunks += end - req.index
                self.served_bytes += nbytes
                ver.served_bytes += nbytes
                return
        self._sock.send_multipart([*prefix, *codec.encode(err)])
