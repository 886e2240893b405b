"""A real ``ThreadedEngine`` whose every sampled token names the weights that produced it.

``ChecksumEngine`` holds one float32 weight vector (``"w"``).  Each decoding step emits,
for every running request, the token ``weights_token(w)`` — a crc32 of the weights it
holds at that moment — tagged with the engine's version.  A checker that knows what each
published version's weights are can therefore tell, token by token, whether the version
label is true (``token == weights_token(weights of that version)``) and whether the
engine ever sampled from a half-copied (torn) vector (a token matching no version).

It behaves like the production engines where it matters for the weight hand-over: the
swap is deferred to the engine thread's safe point, the copy out of the caller's tensors
is slow and piecewise (``copy_pause_s`` between slices) while the caller's trio thread
runs on, and the caller's tensors are read *during* that copy — so a caller that reused
the receive buffer before the swap was released would be caught.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from turnscale.actors.engine import FINISH_LENGTH, EngineError, GenerateResult, Pending, ThreadedEngine


def weights_token(w: np.ndarray) -> int:
    """The token an engine holding ``w`` samples (a checksum of the weights, as int32)."""
    return zlib.crc32(np.ascontiguousarray(w, dtype=np.float32).tobytes()) & 0x7FFFFFFF


def version_weights(version: int, size: int, salt: int = 0) -> np.ndarray:
    """Deterministic, distinct weights for a version (``salt`` tells two learners apart)."""
    return (np.arange(size, dtype=np.float32) * 1e-3 + version + 1000.0 * salt).astype(np.float32)


@dataclass(eq=False)
class _Row:
    p: Pending
    tokens: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


class ChecksumEngine(ThreadedEngine):
    """See the module docstring.  ``step_s`` paces decoding; ``slices``/``copy_pause_s`` pace the swap."""

    def __init__(self, *, size: int = 4096, update_mode: str = "between_turns", max_batch: int = 8,
                 step_s: float = 0.001, slices: int = 8, copy_pause_s: float = 0.002, fail_versions: tuple[int, ...] = ()) -> None:
        super().__init__(max_batch=max_batch, update_mode=update_mode, name="checksum")
        self.w = version_weights(0, size)
        self.step_s = step_s
        self.slices = slices
        self.copy_pause_s = copy_pause_s
        self.fail_versions = set(fail_versions)
        self.applied: list[int] = []
        self._rows: list[_Row] = []
        self._applying: int | None = None
        self._start()

    # -- weights -------------------------------------------------------------------------
    def weights_digest(self, names, dtype: str, algo: str) -> dict[str, int]:
        from turnscale.actors.engine import tensor_digest

        return tensor_digest({"w": self.w.copy()}, dtype, algo)

    def _check_weights(self, tensors: Mapping[str, Any]) -> None:
        if set(tensors) != {"w"} or tuple(tensors["w"].shape) != self.w.shape:
            raise EngineError(f"checksum engine takes one tensor 'w' of shape {self.w.shape}")

    def _apply_weights(self, tensors: Mapping[str, Any]) -> None:
        src = np.asarray(tensors["w"])
        version = self._applying
        if version in self.fail_versions:
            raise EngineError(f"injected failure applying version {version}")
        bounds = np.linspace(0, len(self.w), self.slices + 1).astype(int)
        for a, b in zip(bounds[:-1], bounds[1:]):
            self.w[a:b] = src[a:b]  # reads the caller's memory, slice by slice
            time.sleep(self.copy_pause_s)
        self.applied.append(version)

    def _maybe_apply_weights(self) -> None:
        with self._cond:  # remember which version _apply_weights is about to install
            pw = self._pending_weights
        self._applying = pw[0].version if pw is not None else None
        super()._maybe_apply_weights()

    # -- decoding ------------------------------------------------------------------------
    def _active(self) -> list[Pending]:
        return [r.p for r in self._rows]

    def _admit(self, joiners: list[Pending]) -> list[tuple[Pending, GenerateResult]]:
        self._rows += [_Row(p) for p in joiners]
        return []

    def _step(self) -> list[tuple[Pending, GenerateResult]]:
        time.sleep(self.step_s)
        tok = weights_token(self.w)
        done = []
        for r in self._rows:
            r.tokens.append(tok)
            r.versions.append(self._version)
            if len(r.tokens) >= r.p.req.sampling.max_new_tokens:
                done.append(r)
        self._rows = [r for r in self._rows if r not in done]
        return [(r.p, self._result(r, FINISH_LENGTH)) for r in done]

    def _result(self, r: _Row, reason: str) -> GenerateResult:
        versions = np.array(r.versions, np.int32)
        return GenerateResult(token_ids=np.array(r.tokens, np.int32), logprobs=np.full(len(r.tokens), -0.5, np.float32),
                              finish_reason=reason, policy_version=int(versions.min()) if len(versions) else self._version,
                              latency_s=time.monotonic() - r.p.submitted, token_versions=versions)

    def _drop(self, gone: list[Pending]) -> None:
        self._rows = [r for r in self._rows if r.p not in gone]

    def _reset_batch(self) -> None:
        self._rows = []

    def _partial_result(self, p: Pending, reason: str) -> GenerateResult:
        for r in self._rows:
            if r.p is p:
                return self._result(r, reason)
        return self._aborted_result(p)
