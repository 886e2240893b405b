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
"""

from __future__ import annotations

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

    def array(self, values: Any, dtype: Any) -> np.ndarray:
        """A new 1-D array of ``dtype`` holding ``values`` (a sequence or an array), in the arena."""
        dt = np.dtype(dtype)
        n = len(values)
        nbytes = n * dt.itemsize
        start = -(-self._used // ALIGN) * ALIGN
        if self._block is None or start + nbytes > len(self._block):
            size = max(self._next, nbytes + ALIGN)
            self._block, start = np.empty(size, np.uint8), 0
            self._next = size * 2
            self.blocks += 1
        else:
            self._block[self._used:start] = 0  # padding travels with the arrays: no stale bytes
        out = self._block[start:start + nbytes].view(dt)
        out[:] = values
        self._used = start + nbytes
        return out
