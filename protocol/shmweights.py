"""Same-host weight segments: a version's weight stream in shared memory, and the checks
that keep a reader from ever taking a torn or overwritten one.

The learner's publisher keeps each servable version's stream (the exact bytes the TCP
path serves, ``protocol/weights.py`` layout) in a ``Segment``: an anonymous shared-memory
file (``memfd``, tmpfs pages like ``/dev/shm``) that it maps once and reuses for later
versions.  Actors on the same host open it through ``/proc/<learner pid>/fd/<fd>``
(``SegmentRef.path``), take a shared lock on it (``SegmentReader.hold``), verify every
chunk in place against the same manifest checksums as the TCP path and hand the engine
tensors that view the segment: no copy on the actor's side.  A memfd has no name in any
file system, so nothing can leak: the kernel frees it when the last process holding it
(the learner, or an actor's mapping) exits, however it exits.

Header (``HEADER_BYTES``, little endian): magic ``b"TSWSEG01"``, a 16-byte random token,
then ``seq`` (u64) and ``version`` (i64); the stream starts at ``HEADER_BYTES``.

Ordering contract (``flock`` on the memfd's inode plus a seqlock in the header):

- writer: rewrites a segment only under an exclusive lock taken without waiting
  (``try_lock``; a segment a reader holds is not reused, the publisher takes another);
  ``begin_write`` makes ``seq`` odd and ``version`` -1 before a byte changes, ``end_write``
  sets ``version`` and makes ``seq`` even again only after the whole stream is written and
  checksummed, then ``unlock``;
- reader: ``hold(version)`` takes a shared lock without waiting (fails while a write is
  in progress), then requires ``seq`` even and ``version`` the one wanted; while the hold
  lasts the bytes cannot change, so the chunk checksums it verifies stay true for the
  tensors that view them.  ``Hold.release`` (the actor: once the engine released the
  tensors and the post-swap check ran) lets the writer reuse the segment.  Each hold has
  its own open file (locks of two holds never merge); a crashed reader's locks vanish
  with it.  ``Hold.verify`` re-reads ``seq`` after the checksums as a second guard.

Same-host detection: the ref names the path *and* the token; a reader that cannot open
the path, or finds another token there (another host's learner with the same pid, a
different PID namespace), gets ``SegmentUnavailable`` and pulls over TCP instead.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from turnscale.protocol import checksums
from turnscale.protocol.errors import TurnscaleError

MAGIC = b"TSWSEG01"
HEADER_BYTES = 4096
"""The stream starts here (page aligned)."""
_HEAD = struct.Struct("<8s16s")
_SEQ_AT = _HEAD.size
_VERSION_AT = _SEQ_AT + 8
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")


class SegmentUnavailable(TurnscaleError):
    """The segment cannot be read from here (another host, gone, or another token)."""


class SegmentChanged(TurnscaleError):
    """The segment no longer holds the wanted version (it was or is being overwritten)."""


@dataclass(frozen=True, slots=True)
class SegmentRef:
    """Where a reader on the same host finds a segment (announced next to the manifest)."""

    path: str
    """``/proc/<pid>/fd/<fd>`` of the learner's memfd."""
    token: str
    """Hex of the segment's random token (checked in its header)."""


class Segment:
    """The writer's end: one memfd of ``HEADER_BYTES + capacity`` bytes, mapped read-write.

    ``stream`` is a numpy view of the stream area; the publisher lays versions into it."""

    def __init__(self, capacity: int, *, name: str = "turnscale-weights") -> None:
        self.capacity = capacity
        self.token = secrets.token_bytes(16)
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, HEADER_BYTES + capacity)
            self._map = mmap.mmap(self.fd, HEADER_BYTES + capacity, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        _HEAD.pack_into(self._map, 0, MAGIC, self.token)
        _U64.pack_into(self._map, _SEQ_AT, 0)
        _I64.pack_into(self._map, _VERSION_AT, -1)
        self.stream = np.frombuffer(self._map, dtype=np.uint8, count=capacity, offset=HEADER_BYTES)

    @property
    def ref(self) -> SegmentRef:
        return SegmentRef(path=f"/proc/{os.getpid()}/fd/{self.fd}", token=self.token.hex())

    def try_lock(self) -> bool:
        """Take the exclusive lock without waiting; False while a reader holds the segment."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        return True

    def unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def begin_write(self) -> None:
        """Mark the stream as being rewritten (readers refuse every chunk from now on)."""
        seq = _U64.unpack_from(self._map, _SEQ_AT)[0]
        _I64.pack_into(self._map, _VERSION_AT, -1)
        _U64.pack_into(self._map, _SEQ_AT, seq | 1)

    def end_write(self, version: int) -> None:
        """The stream now holds ``version`` completely (written and checksummed)."""
        seq = _U64.unpack_from(self._map, _SEQ_AT)[0]
        _I64.pack_into(self._map, _VERSION_AT, version)
        _U64.pack_into(self._map, _SEQ_AT, (seq | 1) + 1)

    def close(self) -> None:
        """Unmap and close (readers that still map it keep their pages until they unmap)."""
        if self.fd < 0:
            return
        self.stream = np.empty(0, np.uint8)
        try:
            self._map.close()
        except BufferError:  # a view still exported: the mapping goes with the last view
            pass
        os.close(self.fd)
        self.fd = -1


class SegmentReader:
    """The reader's end: a read-only mapping of a segment named by a ``SegmentRef``.

    Raises ``SegmentUnavailable`` when the path cannot be opened or holds another token."""

    def __init__(self, ref: SegmentRef) -> None:
        self.ref = ref
        try:
            fd = os.open(ref.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise SegmentUnavailable(f"cannot open weight segment {ref.path}: {exc.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise SegmentUnavailable(f"{ref.path} is not a weight segment ({size} bytes)")
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # fault the pages in at once, not one by one
            self._map = mmap.mmap(fd, size, flags, mmap.PROT_READ)
        except OSError as exc:
            raise SegmentUnavailable(f"cannot map weight segment {ref.path}: {exc.strerror}") from None
        finally:
            os.close(fd)
        magic, token = _HEAD.unpack_from(self._map, 0)
        if magic != MAGIC or token.hex() != ref.token:
            self._map.close()
            raise SegmentUnavailable(f"{ref.path} holds another segment (not on the learner's host)")
        self.capacity = size - HEADER_BYTES
        self.stream = np.frombuffer(self._map, dtype=np.uint8, count=self.capacity, offset=HEADER_BYTES)

    def state(self) -> tuple[int, int]:
        """``(seq, version)`` as the header says now."""
        return _U64.unpack_from(self._map, _SEQ_AT)[0], _I64.unpack_from(self._map, _VERSION_AT)[0]

    def hold(self, version: int) -> "Hold | None":
        """A shared lock on the segment while it holds ``version`` completely; None when
        a write is in progress or the segment holds another version (pull over TCP)."""
        try:
            fd = os.open(self.ref.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        seq, held = self.state()
        if seq & 1 or held != version:
            os.close(fd)  # closing the last descriptor drops its lock
            return None
        return Hold(self, fd, seq, version)

    def close(self) -> None:
        self.stream = np.empty(0, np.uint8)
        try:
            self._map.close()
        except BufferError:
            pass


class Hold:
    """A reader's shared lock on a segment holding one version (``SegmentReader.hold``)."""

    def __init__(self, reader: SegmentReader, fd: int, seq: int, version: int) -> None:
        self.reader, self.fd, self.seq, self.version = reader, fd, seq, version

    def verify(self, offset: int, nbytes: int, checksum: int, algo: str) -> np.ndarray:
        """The stream bytes ``[offset, offset + nbytes)``, checked against ``checksum``
        (``SegmentChanged`` when they fail it or lie outside the segment)."""
        if offset < 0 or offset + nbytes > self.reader.capacity:
            raise SegmentChanged(f"chunk [{offset}, {offset + nbytes}) lies outside the {self.reader.capacity}-byte segment")
        view = self.reader.stream[offset:offset + nbytes]
        if checksums.checksum(algo, view) != checksum:
            raise SegmentChanged(f"chunk at {offset} fails its checksum")
        if self.reader.state() != (self.seq, self.version):
            raise SegmentChanged("segment was rewritten while held (a writer that ignores the lock)")
        return view

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.release()
