"""A buffer that a message's arrays are carved from, so that the message travels as few
data frames as possible.

``protocol.codec.encode`` sends out-of-band arrays that tile one region of a buffer they
share as that region: one zero-copy frame, instead of a frame per array (a trajectory group
of 8 episodes has ~25 such arrays; each frame costs both sides' Python, ZeroMQ I/O thread
and pyzmq garbage-collector work, ~0.08 ms per frame at 4 MB groups, benchmarks/README.md).
The actor builds a group's per-token arrays here as its episodes end
(``actors/episode.py``), so a group of any size goes out as a few frames.

Layout: arrays are placed one after another, each at an offset aligned to ``ALIGN`` bytes,
the padding between them zeroed (it travels with them).  When the current block is full a
new one twice its size (at least the array) is started; arrays in different blocks travel
in different frames.  Nothing is ever freed or moved: a block lives as long as an array
carved from it (numpy's ``base``), and an arena is meant for one message.

``BlockSizer`` picks the first block from what recent arenas used, so that a message of
the usual size fits one block and travels as one data frame (a 4 MB group in doubling
blocks from 1 MB took three, and each frame costs both sides; benchmarks/README.md).
The block is virtual memory until written, so sizing it generously costs address space,
not pages.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

ALIGN = 8


class Arena:
    """See the module docstring.  ``first_block_bytes``: the first block's size (virtual
    memory: pages are touched only as arrays are written)."""

    def __init__(self, first_block_bytes: int = 1 << 20) -> None:
        if first_block_bytes < ALIGN:
            raise ValueError(f"first_block_bytes must be at least {ALIGN}")
        self._next = first_block_bytes
        self._block: np.ndarray | None = None
        self._used = 0
        self.blocks = 0
        """Blocks started so far (an upper bound on the data frames the arrays need)."""
        self.used_bytes = 0
        """Bytes of all blocks taken by arrays and their padding."""

    def array(self, values: Any, dtype: Any) -> np.ndarray:
        """A new 1-D array of ``dtype`` holding ``values`` (a sequence or an array), in the arena."""
        dt = np.dtype(dtype)
        n = len(values)
        nbytes = n * dt.itemsize
        start = -(-self._used // ALIGN) * ALIGN
        if self._block is None or start + nbytes > len(self._block):
            size = max(self._next, nbytes + ALIGN)
            self._block, start, self._used = np.empty(size, np.uint8), 0, 0
            self._next = size * 2
            self.blocks += 1
        else:
            self._block[self._used:start] = 0  # padding travels with the arrays: no stale bytes
        out = self._block[start:start + nbytes].view(dt)
        out[:] = values
        self.used_bytes += start + nbytes - self._used
        self._used = start + nbytes
        return out


class BlockSizer:
    """The first block for the next arena: ``headroom`` times the most any of the last
    ``keep`` arenas used, rounded up to a MiB, between ``floor`` and ``cap`` bytes.  One
    sizer per stream of similar messages (an actor's trajectory groups)."""

    def __init__(self, floor: int = 1 << 20, cap: int = 256 << 20, keep: int = 16, headroom: float = 1.25) -> None:
        if not ALIGN <= floor <= cap:
            raise ValueError(f"need {ALIGN} <= floor <= cap, got floor={floor} cap={cap}")
        self.floor, self.cap, self.headroom = floor, cap, headroom
        self._recent: deque[int] = deque(maxlen=keep)

    def first_block_bytes(self) -> int:
        want = int(max(self._recent, default=0) * self.headroom)
        want = -(-want // (1 << 20)) * (1 << 20)
        return min(self.cap, max(self.floor, want))

    def arena(self) -> Arena:
        """A new arena whose first block this sizer chose."""
        return Arena(self.first_block_bytes())

    def observe(self, arena: Arena) -> None:
        """Remember what ``arena`` (a finished message's) used."""
        self._recent.append(arena.used_bytes)
