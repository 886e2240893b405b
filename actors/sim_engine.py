"""``engine=sim``: real token ids after cost-model delays, for throughput benchmarks.

Runs the same threaded continuous-batching loop as the real engines (``ThreadedEngine``:
same admission, abort, weight-swap and stats behaviour), but a "decoding step" is a
sleep on a shared batch clock: ``decode_s_per_step`` per step for the whole batch, plus
``prefill_s_per_token`` per prompt token of the requests joining at that step.

Each request's output length is drawn from its seeded generator: with probability
``long_tail`` the turn runs to ``max_new_tokens`` (``finish_reason="length"``), otherwise
a geometric length with mean ``mean_new_tokens`` ending with the stop token (the first
of ``stop_token_ids``, else the tokenizer's eos).  The ids spell a response from a fixed
pool of agent-style texts (``Thought: ... Action: ...``), so parsers and renderers see
real text.  Log-probs are a fixed plausible value (``SIM_LOGPROB``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from turnscale.actors.engine import FINISH_LENGTH, FINISH_STOP, GenerateResult, Pending, ThreadedEngine

SIM_LOGPROB = -0.7

RESPONSES = (
    "Thought: The goal is ahead of me, I should move closer.\nAction: move forward",
    "Thought: I need to look at what is around me first.\nAction: turn left",
    "Thought: I have what I need.\nAction: pickup red ball 1",
    "Thought: Let me check my inventory.\nAction: inventory",
    "I should look this up. <search> capital of the country </search>",
    "The answer is clear. <answer> paris </answer>",
    "Let me click the link.\n```click [1234]```",
)


@dataclass(eq=False)
class _SimRow:
    p: Pending
    plan: list[int]
    reason: str
    n: int = 0
    versions: list[int] = field(default_factory=list)
    """One entry per emitted token (appended in step with ``n``)."""

    @property
    def ids(self) -> list[int]:
        return self.plan[: self.n]

    @property
    def logprobs(self) -> np.ndarray:
        return np.full(self.n, SIM_LOGPROB, dtype=np.float32)


class SimEngine(ThreadedEngine):
    """See the module docstring.  ``cfg`` is ``conf.schema.EngineConfig`` (uses ``cfg.sim``)."""

    def __init__(self, cfg: Any, tokenizer: Any, *, version: int = 0) -> None:
        super().__init__(max_batch=cfg.max_batch, update_mode=cfg.update_mode, version=version, name="sim")
        self.sim = cfg.sim
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id
        self._pool = [tokenizer.encode(t, add_special_tokens=False) for t in RESPONSES]
        self._rng = np.random.default_rng(self.sim.seed)
        self._rows: list[_SimRow] = []
        self._start()

    def _active(self) -> list[Pending]:
        return [r.p for r in list(self._rows)]

    def _plan(self, p: Pending) -> _SimRow:
        rng = np.random.default_rng(p.req.seed) if p.req.seed is not None else np.random.default_rng(self._rng.integers(1 << 62))
        max_new = p.req.sampling.max_new_tokens
        text = self._pool[int(rng.integers(len(self._pool)))]
        if rng.random() < self.sim.long_tail:
            n, reason = max_new, FINISH_LENGTH
        else:
            n = int(rng.geometric(1.0 / max(1, self.sim.mean_new_tokens)))
            n, reason = (n, FINISH_STOP) if n <= max_new else (max_new, FINISH_LENGTH)
        stop = p.req.stop_token_ids[0] if p.req.stop_token_ids else self.eos
        body = (text * (n // max(1, len(text)) + 1))[: n - 1 if reason == FINISH_STOP else n]
        plan = body + ([stop] if reason == FINISH_STOP else [])
        return _SimRow(p=p, plan=plan, reason=reason)

    def _admit(self, joiners: list[Pending]) -> list[tuple[Pending, GenerateResult]]:
        time.sleep(self.sim.prefill_s_per_token * sum(len(p.req.prompt_ids) for p in joiners))
        self._rows = self._rows + [self._plan(p) for p in joiners]
        return []

    def _step(self) -> list[tuple[Pending, GenerateResult]]:
        time.sleep(self.sim.decode_s_per_step)
        done, keep = [], []
        for r in self._rows:
            r.n += 1
            r.versions.append(self._version)
            if r.n >= len(r.plan):
                done.append((r.p, self._row_result(r, r.reason)))
            else:
                keep.append(r)
        self._rows = keep
        return done

    def _drop(self, gone: list[Pending]) -> None:
        ids = {p.rid for p in gone}
        self._rows = [r for r in self._rows if r.p.rid not in ids]

    def _reset_batch(self) -> None:
        self._rows = []

    def _row_of(self, p: Pending) -> _SimRow | None:
        return next((r for r in self._rows if r.p is p), None)

    def _check_weights(self, tensors: Mapping[str, Any]) -> None:
        """Any named tensors are accepted (the sim has no parameters)."""

    def _apply_weights(self, tensors: Mapping[str, Any]) -> None:
        """Nothing to copy: only the version changes."""
