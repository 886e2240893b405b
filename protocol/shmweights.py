"""Same-host weight segments: a version's weight stream in shared memory, and the checks
that keep a reader from ever taking a torn or overwritten one.

The learner's publisher keeps each servable version's stream (the exact bytes the TCP
path serves, ``protocol/weights.py`` layout) in a ``Segment``: an anonymous shared-memory
file (``memfd``, tmpfs pages like ``/dev/shm``) that it maps once and reuses for later
versions.  Actors on the same host open it through ``/proc/<learner pid>/fd/<fd>``
(``SegmentRef.path``) and copy the chunks into their own receive buffer, checking every
chunk against the same manifest checksums as the TCP path.  A memfd has no name in any
file system, so nothing can leak: the kernel frees it when the last process holding it
(the learner, or an actor's mapping) exits, however it exits.

Header (``HEADER_BYTES``, little endian): magic ``b"TSWSEG01"``, a 16-byte random token,
then ``seq`` (u64) and ``version`` (i64); the stream starts at ``HEADER_BYTES``.

Ordering contract (a seqlock):

- writer (``begin_write`` / ``end_write``): ``seq`` becomes odd and ``version`` -1 before
  a byte of the stream is rewritten; ``version`` is set and ``seq`` made even again only
  after the whole stream is written and checksummed;
- reader (``SegmentReader.copy_chunk``): reads ``seq`` (must be even) and ``version``
  (must be the one wanted) before copying a chunk, then verifies the copy's checksum
  against the manifest, then reads ``seq`` again (must be unchanged).  A chunk passes
  only if all three hold, so a chunk overwritten during the copy is never accepted, even
  if its bytes happen to checksum (the seq check) or the seq check races (the checksum).

Same-host detection: the ref names the path *and* the token; a reader that cannot open
the path, or finds another token there (another host's learner with the same pid, a
different PID namespace), gets ``SegmentUnavailable`` and pulls over TCP instead.
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from protocol import checksums
from protocol.errors import TurnscaleError

MAGIC = b"TSWSEG01"
HEADER_BYTES = 4096
"""The stream starts here (page aligned)."""
_HEAD = struct.Struct("<8s16s")
_SEQ_AT = _HEAD.size
_VERSION_AT = _SEQ_AT + 8
_U64 = struct.Struct("<Q")
_PIECE = 1 << 20
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

    def copy_chunk(self, version: int, offset: int, nbytes: int, checksum: int, algo: str, out: Any) -> None:
        """Copy stream bytes ``[offset, offset + nbytes)`` of ``version`` into ``out`` and
        verify them (see the ordering contract); ``SegmentChanged`` when any check fails
        (``out`` may then hold garbage: the caller pulls that chunk elsewhere)."""
        seq, held = self.state()
        if seq & 1 or held != version:
            raise SegmentChanged(f"segment holds version {held}{' (being written)' if seq & 1 else ''}, not {version}")
        if offset < 0 or offset + nbytes > self.capacity:
            raise SegmentChanged(f"chunk [{offset}, {offset + nbytes}) lies outside the {self.capacity}-byte segment")
        crc, src = 0, self.stream
        for p in range(0, nbytes, _PIECE):  # copy and checksum piece by piece, while the piece is in cache
            piece = out[p:p + _PIECE]
            piece[:] = src[offset + p:offset + p + piece.nbytes]
            crc = checksums.update(algo, crc, piece)
        if crc != checksum:
            raise SegmentChanged(f"chunk at {offset} fails its checksum (overwritten while copied)")
        if self.state()[0] != seq:
            raise SegmentChanged("segment was rewritten while the chunk was copied")

    def close(self) -> None:
        self.stream = np.empty(0, np.uint8)
        try:
            self._map.close()
        except BufferError:
            pass
