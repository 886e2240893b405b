"""Actor side of weight publication: pull a version's chunks from the learner's weights
ROUTER into one preallocated buffer, verify each checksum, return tensors.  The actor's end
of the weight-transfer protocol (``protocol/weights.py``; the learner's end is
``learner/weights.py``).

Wire: request ``[request_id, *WeightChunkRequest]`` (a run of ``count`` chunks) on a
DEALER; replies ``[request_id, *WeightChunk]``, one message per chunk of the run, in order
(each a header frame and a data frame; a reply with several chunks in order is accepted
too), or ``[request_id, *ErrorReply]``.  The 16-byte request id encodes ``(version, first index,
request number)`` (unique within the pull: two runs from two sources may start at one
chunk), so when a reply arrives we already know which chunk comes next and receive each
data frame with ``recv_into`` straight into its place in the buffer (no intermediate copy).
Up to ``window`` requests are in flight.

Contract:

- ``sock`` (and every relay socket) is used only by this call while it runs (its own
  DEALER connected to the weights endpoint; ``Welcome.weights_endpoint``).
- Every chunk is checked: size, the decoded ``WeightChunk`` (version, index, checksum
  field) and the checksum recomputed over the received bytes against the manifest.  A
  chunk that times out or fails a check is re-requested, at most ``max_retries`` times;
  then ``WeightSyncError`` (``ChecksumMismatch`` for corruption).  An ``ErrorReply``
  raises ``RemoteError`` (e.g. ``unknown_version``: pull the latest announced version).
- Replies to earlier attempts or other versions are discarded, never written over a
  verified chunk.
- Relays (``relays``: other actors' ``RelayServer``s, ``actors/relay.py``, nearest first)
  are asked before ``sock``, per chunk.  Every chunk is checked the same way whatever
  its source.  A relay's chunk that fails a check, an ``ErrorReply`` from a relay
  (``unknown_version``: it moved past this version), a ``not_yet`` that lasts past
  ``relay_patience_s`` (the relay's own pull is stuck or skipped the version) or no
  reply within ``relay_timeout_s`` (the relay is taken for dead and skipped for the rest
  of the pull) move that chunk to the next source, ultimately the learner, where
  ``max_retries`` applies as above.  So a relay can cost time, never a torn or wrong
  version: the buffer is handed out only when every chunk verified.
- ``on_chunk(i)`` is called once chunk ``i`` is in the buffer and verified (never again
  written during this pull): the actor's own ``RelayServer`` serves it from then on.
- The returned tensors VIEW the receive buffer (``copy=False``, default).  Whoever holds
  them owns the buffer: it must not be pulled into again until they are released.  The
  actor keeps two buffers and hands the tensors to the engine (``Engine.load_weights``);
  it pulls into a buffer only after the engine released it (``WeightSwap.released``),
  so a pull never writes into memory the engine may still read.  Pass ``copy=True`` to
  get owned tensors instead.
- Same host (``shm``, a ``protocol.shmweights.SegmentRef`` from the announcement): the
  pull takes a shared lock on the learner's segment for the version (``Hold``), checks
  every chunk in place against the manifest checksums and returns tensors that view the
  segment (read-only memory: no copy).  The hold is attached to ``buffer`` and released
  by ``ReceiveBuffer.release`` or the buffer's next ``take``; until then the learner
  never rewrites that segment.  When the segment does not open from here (another host,
  another token), holds another version, is being written or fails a checksum, the
  version is pulled over TCP into ``buffer`` as usual.  No relays with ``shm``: a relay
  serves from ``buffer``, which a same-host pull leaves empty (an actor on the learner's
  host runs no relay, ``actors.main.relay_address``).
- A buffer (``ReceiveBuffer``) is allocated once and reused across versions:
  first-touching a fresh buffer every time is ~3x slower (FACTS.md).  Without
  ``buffer`` a pull allocates a fresh one.  One pull at a time per buffer.
"""

from __future__ import annotations

import struct
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import trio
import zmq

from turnscale.protocol import checksums, codec
from turnscale.protocol import weights as weights_protocol
from turnscale.protocol.errors import ProtocolError, RemoteError, TurnscaleError
from turnscale.protocol.messages import MAX_CHUNKS_PER_REQUEST, ErrorReply, WeightChunk, WeightChunkRequest, WeightManifest
from turnscale.protocol.shmweights import Hold, SegmentChanged, SegmentReader, SegmentRef, SegmentUnavailable
from turnscale.protocol.transport import AsyncSocket

if TYPE_CHECKING:
    import torch

_RID = struct.Struct("<qiI")  # version, first chunk index of the run, request number within the pull
RUN_BYTES = 1 << 20
"""Default bytes one request asks for (``WeightChunkRequest.count`` = this over the chunk
size, at least 1): small chunks travel several to a request and a reply, so the per-message
CPU of both ends is paid once per run; chunks of this size or more go one by one."""


class WeightSyncError(TurnscaleError):
    """A weight pull failed: a chunk did not arrive or kept failing its checks."""


class ChecksumMismatch(WeightSyncError):
    """A chunk's bytes kept failing their checksum: the learner's copy or the link is corrupt."""


class ReceiveBuffer:
    """One receive buffer, reused across versions; grows (once) when a version is larger.
    After a same-host pull it also carries that pull's ``Hold`` on the learner's segment."""

    def __init__(self, nbytes: int = 0) -> None:
        self.buf = np.empty(nbytes, dtype=np.uint8)
        self.hold: Hold | None = None

    def release(self) -> None:
        """Let go of a same-host pull's segment (the tensors viewing it must be unused)."""
        if self.hold is not None:
            self.hold.release()
            self.hold = None

    def take(self, nbytes: int) -> np.ndarray:
        self.release()
        if self.buf.nbytes < nbytes:
            self.buf = np.empty(nbytes, dtype=np.uint8)
        return self.buf[:nbytes]



def _checksum(algo: str, data: Any) -> int:
    try:
        return checksums.checksum(algo, data)
    except ValueError as exc:
        raise WeightSyncError(f"cannot verify weights: {exc}") from None


class _Pull:
    """State of one pull (see the module docstring).  ``socks[-1]`` is the learner's
    weights endpoint; the ones before it are relays, asked first in order."""

    def __init__(self, socks: list[AsyncSocket], manifest: WeightManifest, buf: np.ndarray, timeout_s: float,
                 window: int, max_retries: int, *, relay_timeout_s: float = 3.0, relay_patience_s: float = 5.0,
                 on_chunk: Callable[[int], None] | None = None, run: int = 1) -> None:
        self.socks = socks
        self.run_chunks = run
        self.m = manifest
        self.buf = buf
        self.timeout_s = timeout_s
        self.window = window
        self.max_retries = max_retries
        self.relay_timeout_s = relay_timeout_s
        self.relay_patience_s = relay_patience_s
        self.on_chunk = on_chunk
        n = len(manifest.chunks)
        self.learner = len(socks) - 1
        self.todo: deque[int] = deque(range(n))
        self.later: list[tuple[float, int]] = []  # (not before, index): chunks a relay did not hold yet
        self.inflight: dict[int, tuple[float, int, int, int, int]] = {}  # request id -> (deadline, first chunk, source, count, next chunk due)
        self.attempts = [0] * n  # attempts at the learner (max_retries applies there)
        self.requests = 0  # request ids: unique within the pull (two runs may start at one chunk, from two sources)
        self.source = [0] * n  # the source chunk i is asked from next
        self.waited_since: dict[int, float] = {}  # first not_yet from the current relay
        self.backoff = [0.002] * n
        self.dead: set[int] = set()  # relays that timed out or failed a send: skipped from now on
        self.done = 0
        self.corrupt: dict[int, str] = {}
        self.error: BaseException | None = None
        self.from_source = [0] * len(socks)  # verified chunks per source
        self.fallbacks = 0  # chunks moved to a later source
        self._progress = trio.Event()

    def _next_source(self, i: int) -> None:
        """Chunk ``i``'s current relay failed it: ask the next live one (ultimately the learner)."""
        s = self.source[i] + 1
        while s < self.learner and s in self.dead:
            s += 1
        self.source[i] = min(s, self.learner)
        self.waited_since.pop(i, None)
        self.backoff[i] = 0.002
        self.fallbacks += 1

    def _wake(self) -> None:
        self._progress.set()

    async def run(self) -> None:
        failed: BaseException | None = None
        async with trio.open_nursery() as nursery:  # receivers never raise: errors land in self.error
            for s in range(len(self.socks)):
                nursery.start_soon(self._receiver, s)
            try:
                await self._drive()
            except (TurnscaleError, trio.TooSlowError) as exc:  # re-raised outside: not as an ExceptionGroup
                failed = exc
            finally:
                nursery.cancel_scope.cancel()
        if failed is not None:
            raise failed

    async def _receiver(self, s: int) -> None:
        sock = self.socks[s]
        while True:
            try:
                await sock._wait(zmq.POLLIN)  # the socket is ours for the call
                while self._recv_one(s):
                    pass
            except BaseException as exc:
                if isinstance(exc, trio.Cancelled):
                    raise
                if self.error is None:
                    self.error = exc
            self._wake()
            await trio.lowlevel.checkpoint()

    async def _drive(self) -> None:
        n = len(self.m.chunks)
        while self.done < n:
            if self.error is not None:
                raise self.error
            self._progress = trio.Event()  # before looking: a reply handled from now on wakes the wait below
            now = trio.current_time()
            due = [x for x in self.later if x[0] <= now]
            if due:  # back in index order: runs stay whole and the earliest chunks go first
                self.later = [x for x in self.later if x[0] > now]
                self.todo = deque(sorted([*self.todo, *(i for _, i in due)]))
            while self.todo and len(self.inflight) < self.window:
                await self._request(self.todo.popleft())
            wake_at = min([d for d, _, _, _, _ in self.inflight.values()] + [t for t, _ in self.later] + [now + 1.0])
            if self.done < n and self.error is None:
                with trio.move_on_at(wake_at):
                    await self._progress.wait()
            now = trio.current_time()
            for r, (d, i, s, count, nxt) in list(self.inflight.items()):
                if d <= now:
                    del self.inflight[r]
                    if s != self.learner:  # a relay that does not answer in time is taken for dead
                        self.dead.add(s)
                    for j in range(nxt, i + count):
                        if s != self.learner:
                            self._next_source(j)
                        self.todo.append(j)
        if self.error is not None:
            raise self.error

    def _source_of(self, i: int) -> int:
        """Chunk ``i``'s source now (a dead relay is skipped); at the learner, counts the
        attempt and raises once ``max_retries`` is spent."""
        while self.source[i] < self.learner and self.source[i] in self.dead:
            self._next_source(i)
        s = self.source[i]
        if s == self.learner:
            if self.attempts[i] > self.max_retries:
                if i in self.corrupt:
                    raise ChecksumMismatch(f"weights v{self.m.version} chunk {i}: {self.corrupt[i]} after "
                                           f"{self.attempts[i]} attempts")
                raise WeightSyncError(f"weights v{self.m.version} chunk {i}: no reply after {self.attempts[i]} attempts "
                                      f"of {self.timeout_s:.1f}s; is the learner's weights endpoint reachable?")
            self.attempts[i] += 1
        return s

    async def _request(self, i: int) -> None:
        """Ask chunk ``i``'s source for the run ``i, i + 1, ...``: the next chunks in ``todo``
        that follow on and have the same source, up to ``run_chunks``."""
        s = self._source_of(i)
        count = 1
        while (count < self.run_chunks and self.todo and self.todo[0] == i + count
               and self.source[i + count] == s and (s == self.learner or s not in self.dead)):
            self._source_of(self.todo.popleft())
            count += 1
        self.requests += 1
        r = self.requests
        rid = _RID.pack(self.m.version, i, r)
        frames = [rid, *codec.encode(WeightChunkRequest(version=self.m.version, index=i, count=count))]
        # in flight before the send: the send may yield, and the reply may be handled before it returns
        timeout = self.timeout_s if s == self.learner else self.relay_timeout_s
        self.inflight[r] = (trio.current_time() + timeout, i, s, count, i)
        if s == self.learner:
            await self.socks[s].send_multipart(frames)
            return
        with trio.move_on_after(min(self.relay_timeout_s, 0.5)) as scope:  # a DEALER to a dead peer blocks on send
            await self.socks[s].send_multipart(frames)
        if scope.cancelled_caught:  # nothing was sent (AsyncSocket: a cancelled send sent nothing)
            self.inflight.pop(r, None)
            self.dead.add(s)
            for j in reversed(range(i, i + count)):
                self._next_source(j)
                self.todo.appendleft(j)

    def _discard_rest(self, raw: zmq.Socket) -> None:
        while raw.getsockopt(zmq.RCVMORE):
            raw.recv_into(bytearray(), flags=zmq.NOBLOCK)

    def _recv_one(self, s: int) -> bool:
        """Handle one reply from source ``s`` if one is queued; False when none is.  Never
        blocks: ZeroMQ delivers multipart messages atomically, so once the first frame is
        here, all are.  A reply carries chunks of a run in order from the first one not yet
        received (each a header frame and a data frame, received straight into its place),
        usually one: the learner and relays send a message per chunk, so that a relay can
        forward each chunk as soon as it has verified it.  The rest of the run follows in
        later replies to the same request (the run stays in flight, its deadline renewed)."""
        raw = self.socks[s].sock
        try:
            rid = raw.recv(zmq.NOBLOCK)
        except zmq.Again:
            return False
        if len(rid) != _RID.size or not raw.getsockopt(zmq.RCVMORE):
            self._discard_rest(raw)
            return True
        version, i, r = _RID.unpack(rid)
        header = raw.recv(zmq.NOBLOCK)
        run = self.inflight.get(r) if version == self.m.version else None
        current = run is not None and run[1] == i and run[2] == s
        if not current:  # late reply of an earlier attempt, another source or version: drop it
            self._discard_rest(raw)
            return True
        assert run is not None
        count, nxt = run[3], run[4]
        if not raw.getsockopt(zmq.RCVMORE):  # no data frame: an ErrorReply (or inline data)
            del self.inflight[r]
            self._small_reply(nxt, i + count, header, s)
            return True
        j = nxt
        while True:
            c = self.m.chunks[j]
            view = self.buf[c.offset:c.offset + c.nbytes]
            got = raw.recv_into(view, flags=zmq.NOBLOCK)
            self._verify(j, version, [header, memoryview(view)], view, got, False, s)
            j += 1
            if not raw.getsockopt(zmq.RCVMORE):
                break
            header = raw.recv(zmq.NOBLOCK)
            if j == i + count or not raw.getsockopt(zmq.RCVMORE):  # more than the run, or a header without data
                self._discard_rest(raw)
                break
        if j < i + count:  # the rest of the run follows in later replies
            timeout = self.timeout_s if s == self.learner else self.relay_timeout_s
            self.inflight[r] = (trio.current_time() + timeout, i, s, count, j)
            return True
        del self.inflight[r]
        return True

    def _small_reply(self, i: int, end: int, header: Any, s: int) -> None:
        """A reply of one frame for chunks ``i .. end - 1`` of a run: an ``ErrorReply`` for
        all of them, or chunk ``i`` with its data inline (the others are asked for again)."""
        try:
            msg = codec.decode([header], expect=(ErrorReply, WeightChunk))
        except ProtocolError as exc:
            if s == self.learner:
                raise WeightSyncError(f"weights v{self.m.version} chunk {i}: undecodable reply ({exc})") from None
            for j in range(i, end):
                self._relay_failed(j, f"undecodable reply ({exc})")
            return
        if isinstance(msg, ErrorReply):
            if s == self.learner:
                raise RemoteError(msg.code, msg.message, msg.retryable)
            for j in range(i, end):
                self._relay_refused(j, msg)
            return
        c = self.m.chunks[i]
        view = self.buf[c.offset:c.offset + c.nbytes]
        if msg.data.nbytes == c.nbytes:
            view[:] = msg.data
        self._verify(i, self.m.version, [header], view, msg.data.nbytes, False, s)
        self.todo.extendleft(reversed(range(i + 1, end)))

    def _relay_failed(self, i: int, why: str) -> None:
        self.corrupt[i] = why
        self._next_source(i)
        self.todo.append(i)

    def _relay_refused(self, i: int, err: ErrorReply) -> None:
        """A relay does not hold chunk ``i`` (yet): ask it again a little later, within
        ``relay_patience_s``; any other refusal moves the chunk to the next source."""
        now = trio.current_time()
        if err.code == "not_yet" and now - self.waited_since.setdefault(i, now) < self.relay_patience_s:
            self.later.append((now + self.backoff[i], i))
            self.backoff[i] = min(self.backoff[i] * 2, 0.05)
            return
        self._next_source(i)
        self.todo.append(i)

    def _verify(self, i: int, version: int, frames: list, view: np.ndarray, got: int, extra: bool, s: int) -> None:
        """Check chunk ``i`` now in ``view``; mark it done or queue it again (from the next
        source when a relay sent it)."""
        c = self.m.chunks[i]
        problem = ""
        if got != c.nbytes or extra:
            problem = f"reply of {got} bytes, expected {c.nbytes}"
        else:
            try:
                msg = codec.decode(frames, expect=WeightChunk)
                if msg.version != version or msg.index != i or msg.checksum != c.checksum:
                    problem = "reply header does not match the manifest"
                elif _checksum(self.m.checksum_algo, view) != c.checksum:
                    problem = "checksum mismatch"
            except ProtocolError as exc:
                problem = f"bad reply ({exc})"
        if problem:
            if s != self.learner:
                self._relay_failed(i, problem)
                return
            self.corrupt[i] = problem
            self.todo.append(i)
        else:
            self.corrupt.pop(i, None)
            self.done += 1
            self.from_source[s] += 1
            if self.on_chunk is not None:
                self.on_chunk(i)


def tensors_from_buffer(buf: np.ndarray, manifest: WeightManifest, *, copy: bool = False) -> dict[str, torch.Tensor]:
    """Tensors of ``manifest`` viewing (or copied out of) the stream bytes in ``buf``."""
    try:
        return weights_protocol.tensors_from_buffer(buf, manifest, copy=copy)
    except ProtocolError as exc:
        raise WeightSyncError(str(exc)) from None


@dataclass
class PullReport:
    """Where a pull's chunks came from (filled in by ``pull_weights`` when given)."""

    from_relays: int = 0
    from_learner: int = 0
    fallbacks: int = 0
    """Chunks a relay failed (dead, timed out, refused, wrong bytes) that were asked elsewhere."""
    dead_relays: list[int] = field(default_factory=list)
    from_shm: int = 0
    """Chunks read in place from the learner's shared-memory segment (same host)."""
    shm_error: str = ""
    """Why the segment was not used (empty: it was, or none was offered)."""


_READERS: OrderedDict[tuple[str, str], SegmentReader] = OrderedDict()
_READERS_LOCK = threading.Lock()
_MAX_READERS = 4
"""Mappings kept open (the learner keeps ``keep`` segments, reused across versions)."""


def segment_reader(ref: SegmentRef) -> SegmentReader:
    """A cached read-only mapping of ``ref`` (``SegmentUnavailable`` when it does not open
    from here); the oldest mapping is dropped beyond ``_MAX_READERS``."""
    key = (ref.path, ref.token)
    with _READERS_LOCK:
        reader = _READERS.get(key)
        if reader is not None:
            _READERS.move_to_end(key)
            return reader
    reader = SegmentReader(ref)
    with _READERS_LOCK:
        _READERS[key] = reader
        while len(_READERS) > _MAX_READERS:
            _READERS.popitem(last=False)[1].close()
    return reader


def drop_segment_readers() -> None:
    """Unmap every cached segment (tests; an actor leaving a learner)."""
    with _READERS_LOCK:
        while _READERS:
            _READERS.popitem()[1].close()


def read_segment(ref: SegmentRef, manifest: WeightManifest, report: PullReport | None = None) -> tuple[np.ndarray, Hold] | None:
    """The verified stream of ``manifest`` viewed in place in the learner's segment, with
    the ``Hold`` that keeps it unchanged; None (and ``report.shm_error`` says why) when the
    segment cannot give the whole version."""
    try:
        reader = segment_reader(ref)
        hold = reader.hold(manifest.version)
        if hold is None:
            raise SegmentChanged(f"segment holds version {reader.state()[1]} or is being written, not {manifest.version}")
    except (SegmentUnavailable, SegmentChanged) as exc:
        if report is not None:
            report.shm_error = str(exc)
        return None
    try:
        for c in manifest.chunks:
            hold.verify(c.offset, c.nbytes, c.checksum, manifest.checksum_algo)
    except SegmentChanged as exc:
        hold.release()
        if report is not None:
            report.shm_error = str(exc)
        return None
    except ValueError as exc:  # checksum algorithm unknown here
        hold.release()
        raise WeightSyncError(f"cannot verify weights: {exc}") from None
    if report is not None:
        report.from_shm += len(manifest.chunks)
    return reader.stream[:manifest.total_bytes], hold


async def pull_weights(sock: AsyncSocket, manifest: WeightManifest, *, timeout_s: float = 30.0, window: int = 4,
                       max_retries: int = 3, buffer: ReceiveBuffer | None = None, copy: bool = False,
                       relays: Sequence[AsyncSocket] = (), relay_timeout_s: float = 3.0, relay_patience_s: float = 5.0,
                       on_chunk: Callable[[int], None] | None = None, report: PullReport | None = None,
                       shm: SegmentRef | None = None, run_bytes: int = RUN_BYTES) -> dict[str, torch.Tensor]:
    """Pull every chunk of ``manifest`` (see the module docstring); returns name -> tensor
    in the manifest's dtypes and shapes.  ``shm`` (same host) is read first, then
    ``relays``, in order; ``sock`` (the learner's weights endpoint) last.  ``on_chunk(i)``
    is called once chunk ``i`` is in the buffer and verified (a ``RelayServer`` serves it
    from then on)."""
    buf = await pull_stream(sock, manifest, timeout_s=timeout_s, window=window, max_retries=max_retries, buffer=buffer,
                            relays=relays, relay_timeout_s=relay_timeout_s, relay_patience_s=relay_patience_s,
                            on_chunk=on_chunk, report=report, shm=shm, run_bytes=run_bytes)
    return tensors_from_buffer(buf, manifest, copy=copy)


async def pull_stream(sock: AsyncSocket, manifest: WeightManifest, *, timeout_s: float = 30.0, window: int = 4,
                      max_retries: int = 3, buffer: ReceiveBuffer | None = None, relays: Sequence[AsyncSocket] = (),
                      relay_timeout_s: float = 3.0, relay_patience_s: float = 5.0,
                      on_chunk: Callable[[int], None] | None = None, report: PullReport | None = None,
                      shm: SegmentRef | None = None, run_bytes: int = RUN_BYTES) -> np.ndarray:
    """``pull_weights`` without the tensors (no torch): the verified stream bytes, a view
    of ``buffer``.  Each request asks for a run of up to ``run_bytes`` of chunks (at least
    one chunk, at most ``MAX_CHUNKS_PER_REQUEST``)."""
    if window < 1 or max_retries < 0 or timeout_s <= 0:
        raise ValueError("window >= 1, max_retries >= 0 and timeout_s > 0 are required")
    buffer = buffer or ReceiveBuffer()
    buf = buffer.take(manifest.total_bytes)
    if shm is not None and manifest.chunks and not relays and on_chunk is None:
        got = await trio.to_thread.run_sync(read_segment, shm, manifest, report)  # checksums: off the event loop
        if got is not None:
            view, buffer.hold = got
            return view
    if manifest.chunks:
        run = min(max(run_bytes // max(manifest.chunks[0].nbytes, 1), 1), MAX_CHUNKS_PER_REQUEST)
        pull = _Pull([*relays, sock], manifest, buf, timeout_s, window, max_retries, relay_timeout_s=relay_timeout_s,
                     relay_patience_s=relay_patience_s, on_chunk=on_chunk, run=run)
        try:
            await pull.run()
        finally:
            if report is not None:
                report.from_relays += sum(pull.from_source[:-1])
                report.from_learner += pull.from_source[-1]
                report.fallbacks += pull.fallbacks
                report.dead_relays = sorted(pull.dead)
    return buf


def pull_weights_blocking(endpoint: str, manifest: WeightManifest, *, timeout_s: float = 30.0, window: int = 4,
                          max_retries: int = 3, buffer: ReceiveBuffer | None = None, copy: bool = False,
                          context: zmq.Context | None = None, shm: SegmentRef | None = None,
                          report: PullReport | None = None) -> dict[str, torch.Tensor]:
    """``pull_weights`` for thread code: its own DEALER to ``endpoint``, its own trio run."""
    from turnscale.protocol.transport import configure

    ctx = context or zmq.Context.instance()
    raw = configure(ctx.socket(zmq.DEALER))
    raw.connect(endpoint)

    async def main() -> dict[str, torch.Tensor]:
        sock = AsyncSocket(raw)
        try:
            return await pull_weights(sock, manifest, timeout_s=timeout_s, window=window, max_retries=max_retries,
                                      buffer=buffer, copy=copy, shm=shm, report=report)
        finally:
            sock.close()

    return trio.run(main)
