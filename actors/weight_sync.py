"""Actor side of weight publication: pull a version's chunks from the learner's weights
ROUTER into one preallocated buffer, verify each checksum, return tensors.  The actor's end
of the weight-transfer protocol (``protocol/weights.py``; the learner's end is
``learner/weights.py``).

Wire: request ``[request_id, *WeightChunkRequest]`` on a DEALER; reply
``[request_id, *WeightChunk]`` (or ``[request_id, *ErrorReply]``).  The 16-byte request id
encodes ``(version, index, attempt)``, so when a reply's first frame arrives we already
know which chunk it carries and receive its data frame with ``recv_into`` straight into
its place in the buffer (no intermediate copy).  Up to ``window`` requests are in flight.

Contract:

- ``sock`` is used only by this call while it runs (its own DEALER connected to the
  weights endpoint; ``Welcome.weights_endpoint``).
- Every chunk is checked: size, the decoded ``WeightChunk`` (version, index, checksum
  field) and the checksum recomputed over the received bytes against the manifest.  A
  chunk that times out or fails a check is re-requested, at most ``max_retries`` times;
  then ``WeightSyncError`` (``ChecksumMismatch`` for corruption).  An ``ErrorReply``
  raises ``RemoteError`` (e.g. ``unknown_version``: pull the latest announced version).
- Replies to earlier attempts or other versions are discarded, never written over a
  verified chunk.
- The returned tensors VIEW the receive buffer (``copy=False``, default).  Whoever holds
  them owns the buffer: it must not be pulled into again until they are released.  The
  actor keeps two buffers and hands the tensors to the engine (``Engine.load_weights``);
  it pulls into a buffer only after the engine released it (``WeightSwap.released``),
  so a pull never writes into memory the engine may still read.  Pass ``copy=True`` to
  get owned tensors instead.
- A buffer (``ReceiveBuffer``) is allocated once and reused across versions:
  first-touching a fresh buffer every time is ~3x slower (FACTS.md).  Without
  ``buffer`` a pull allocates a fresh one.  One pull at a time per buffer.
"""

from __future__ import annotations

import struct
from collections import deque
from typing import Any

import numpy as np
import torch
import trio
import zmq

from protocol import checksums, codec
from protocol import weights as weights_protocol
from protocol.errors import ProtocolError, RemoteError, TurnscaleError
from protocol.messages import ErrorReply, WeightChunk, WeightChunkRequest, WeightManifest
from protocol.transport import AsyncSocket

_RID = struct.Struct("<qiI")  # version, chunk index, attempt


class WeightSyncError(TurnscaleError):
    """A weight pull failed: a chunk did not arrive or kept failing its checks."""


class ChecksumMismatch(WeightSyncError):
    """A chunk's bytes kept failing their checksum: the learner's copy or the link is corrupt."""


class ReceiveBuffer:
    """One receive buffer, reused across versions; grows (once) when a version is larger."""

    def __init__(self, nbytes: int = 0) -> None:
        self.buf = np.empty(nbytes, dtype=np.uint8)

    def take(self, nbytes: int) -> np.ndarray:
        if self.buf.nbytes < nbytes:
            self.buf = np.empty(nbytes, dtype=np.uint8)
        return self.buf[:nbytes]



def _checksum(algo: str, data: Any) -> int:
    try:
        return checksums.checksum(algo, data)
    except ValueError as exc:
        raise WeightSyncError(f"cannot verify weights: {exc}") from None


class _Pull:
    """State of one pull (see the module docstring)."""

    def __init__(self, sock: AsyncSocket, manifest: WeightManifest, buf: np.ndarray, timeout_s: float, window: int,
                 max_retries: int) -> None:
        self.sock = sock
        self.raw: zmq.Socket = sock.sock
        self.m = manifest
        self.buf = buf
        self.timeout_s = timeout_s
        self.window = window
        self.max_retries = max_retries
        self.todo = deque(range(len(manifest.chunks)))
        self.inflight: dict[int, tuple[float, int]] = {}  # index -> (deadline, attempt)
        self.attempts = [0] * len(manifest.chunks)
        self.done = 0
        self.corrupt: dict[int, str] = {}

    async def run(self) -> None:
        n = len(self.m.chunks)
        while self.done < n:
            while self.todo and len(self.inflight) < self.window:
                await self._request(self.todo.popleft())
            deadline = min(d for d, _ in self.inflight.values())
            with trio.move_on_at(deadline):
                await self.sock._wait(zmq.POLLIN)  # the socket is ours for the call
                while self._recv_one():
                    pass
                await trio.lowlevel.checkpoint()
            now = trio.current_time()
            for i, (d, _) in list(self.inflight.items()):
                if d <= now:
                    del self.inflight[i]
                    self.todo.append(i)

    async def _request(self, i: int) -> None:
        if self.attempts[i] > self.max_retries:
            if i in self.corrupt:
                raise ChecksumMismatch(f"weights v{self.m.version} chunk {i}: {self.corrupt[i]} after "
                                       f"{self.attempts[i]} attempts")
            raise WeightSyncError(f"weights v{self.m.version} chunk {i}: no reply after {self.attempts[i]} attempts "
                                  f"of {self.timeout_s:.1f}s; is the learner's weights endpoint reachable?")
        self.attempts[i] += 1
        rid = _RID.pack(self.m.version, i, self.attempts[i])
        await self.sock.send_multipart([rid, *codec.encode(WeightChunkRequest(version=self.m.version, index=i))])
        self.inflight[i] = (trio.current_time() + self.timeout_s, self.attempts[i])

    def _discard_rest(self) -> None:
        while self.raw.getsockopt(zmq.RCVMORE):
            self.raw.recv_into(bytearray(), flags=zmq.NOBLOCK)

    def _recv_one(self) -> bool:
        """Handle one reply if one is queued; False when none is.  Never blocks: ZeroMQ
        delivers multipart messages atomically, so once the first frame is here, all are."""
        try:
            rid = self.raw.recv(zmq.NOBLOCK)
        except zmq.Again:
            return False
        if len(rid) != _RID.size or not self.raw.getsockopt(zmq.RCVMORE):
            self._discard_rest()
            return True
        version, i, attempt = _RID.unpack(rid)
        header = self.raw.recv(zmq.NOBLOCK)
        current = version == self.m.version and i in self.inflight and self.inflight[i][1] == attempt
        if not self.raw.getsockopt(zmq.RCVMORE):  # no data frame: an ErrorReply (or inline data)
            if current:
                try:
                    msg = codec.decode([header], expect=(ErrorReply, WeightChunk))
                except ProtocolError as exc:
                    raise WeightSyncError(f"weights v{self.m.version} chunk {i}: undecodable reply ({exc})") from None
                if isinstance(msg, ErrorReply):
                    raise RemoteError(msg.code, msg.message, msg.retryable)
                c = self.m.chunks[i]
                view = self.buf[c.offset:c.offset + c.nbytes]
                if msg.data.nbytes == c.nbytes:
                    view[:] = msg.data
                self._verify(i, version, [header], view, msg.data.nbytes, False)
            return True
        if not current:  # late reply of an earlier attempt, or another version: drop it
            self._discard_rest()
            return True
        c = self.m.chunks[i]
        view = self.buf[c.offset:c.offset + c.nbytes]
        got = self.raw.recv_into(view, flags=zmq.NOBLOCK)
        extra = self.raw.getsockopt(zmq.RCVMORE)
        self._discard_rest()
        self._verify(i, version, [header, memoryview(view)], view, got, bool(extra))
        return True

    def _verify(self, i: int, version: int, frames: list, view: np.ndarray, got: int, extra: bool) -> None:
        """Check chunk ``i`` now in ``view``; mark it done or queue it again."""
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
        del self.inflight[i]
        if problem:
            self.corrupt[i] = problem
            self.todo.append(i)
        else:
            self.corrupt.pop(i, None)
            self.done += 1


def tensors_from_buffer(buf: np.ndarray, manifest: WeightManifest, *, copy: bool = False) -> dict[str, torch.Tensor]:
    """Tensors of ``manifest`` viewing (or copied out of) the stream bytes in ``buf``."""
    try:
        return weights_protocol.tensors_from_buffer(buf, manifest, copy=copy)
    except ProtocolError as exc:
        raise WeightSyncError(str(exc)) from None


async def pull_weights(sock: AsyncSocket, manifest: WeightManifest, *, timeout_s: float = 30.0, window: int = 4,
                       max_retries: int = 3, buffer: ReceiveBuffer | None = None, copy: bool = False) -> dict[str, torch.Tensor]:
    """Pull every chunk of ``manifest`` (see the module docstring); returns name -> tensor
    in the manifest's dtypes and shapes."""
    if window < 1 or max_retries < 0 or timeout_s <= 0:
        raise ValueError("window >= 1, max_retries >= 0 and timeout_s > 0 are required")
    buf = (buffer or ReceiveBuffer()).take(manifest.total_bytes)
    if manifest.chunks:
        await _Pull(sock, manifest, buf, timeout_s, window, max_retries).run()
    return tensors_from_buffer(buf, manifest, copy=copy)


def pull_weights_blocking(endpoint: str, manifest: WeightManifest, *, timeout_s: float = 30.0, window: int = 4,
                          max_retries: int = 3, buffer: ReceiveBuffer | None = None, copy: bool = False,
                          context: zmq.Context | None = None) -> dict[str, torch.Tensor]:
    """``pull_weights`` for thread code: its own DEALER to ``endpoint``, its own trio run."""
    from protocol.transport import configure

    ctx = context or zmq.Context.instance()
    raw = configure(ctx.socket(zmq.DEALER))
    raw.connect(endpoint)

    async def main() -> dict[str, torch.Tensor]:
        sock = AsyncSocket(raw)
        try:
            return await pull_weights(sock, manifest, timeout_s=timeout_s, window=window, max_retries=max_retries,
                                      buffer=buffer, copy=copy)
        finally:
            sock.close()

    return trio.run(main)
