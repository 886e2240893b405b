"""The inference-engine interface the actor depends on, and the trio <-> thread bridge.

An engine turns token ids into token ids plus per-token behaviour log-probs
(``common.logprobs`` convention: ``log_softmax(logits / temperature)`` over the full
vocabulary, before top-p/top-k truncation, float32).  Engines run their decoding loop in
their own thread with continuous batching; trio tasks ``await engine.generate(req)``
through ``ThreadBridge`` and never block the event loop.  Cancelling the awaiting task
aborts the request (the engine drops it at its next decoding step).

Weight updates (``load_weights``) are thread-safe and applied at the engine's next safe
point, chosen by ``EngineConfig.update_mode``:

- ``between_turns`` (default): once a new version is pending the engine admits no new
  requests, lets the running ones finish, swaps, then admits again.  Every token of a
  result was sampled by one version: ``GenerateResult.policy_version``.
- ``inflight``: the swap happens between two decoding steps; running requests continue
  with their KV cache computed by the old weights.  ``GenerateResult.policy_version`` is
  the *minimum* (oldest) version that sampled any of its tokens (the version at the
  request's first token) and ``token_versions`` holds each token's own version.

Weight hand-over (the ordering contract between the caller and the engine thread):

1. ``load_weights(version, tensors)`` validates names and shapes at once (raising
   ``EngineError``) and returns a ``WeightSwap``.  From then on the engine OWNS
   ``tensors`` and the memory behind them: the caller must not write to it.
2. The engine thread applies the swap at its next safe point, then sets ``version``, then
   completes the ``WeightSwap`` as ``applied``.  Every token sampled after that carries the
   new version; none sampled before does.  ``version`` is always the *applied* version,
   never one that is only queued.
3. A swap that fails completes as ``failed`` (``WeightSwap.wait`` raises ``EngineError``)
   and the engine keeps serving the previous weights under the previous version, or, when
   ``_apply_weights`` raised ``EngineBroken`` (the previous weights are gone), it refuses
   every request from then on (``broken`` says why) and must be rebuilt.
4. A newer ``load_weights`` before the swap was applied replaces it: the older one
   completes as ``superseded``; ``close`` completes a pending one as ``closed``.
5. Whatever the outcome, once the ``WeightSwap`` is complete (``released``) the engine holds
   no reference to ``tensors`` or their memory: only then may the caller reuse the buffer
   (the actor pulls the next version into another buffer meanwhile).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from turnscale.protocol.errors import TurnscaleError
from turnscale.protocol.messages import SamplingParams

if TYPE_CHECKING:
    import torch

    from turnscale.conf.schema import EngineConfig

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORTED = "aborted"


class EngineError(TurnscaleError):
    """The engine cannot serve a request or apply weights; the message says why."""


class EngineClosed(EngineError):
    """``generate`` was called on (or was running when) the engine closed."""


class EngineBroken(EngineError):
    """The engine can no longer vouch for its weights (e.g. a swap failed half-way and the
    previous weights could not be restored): it refuses every request until it is rebuilt.
    ``_apply_weights`` raises it instead of a plain error when the old weights are gone."""


class WeightSwap:
    """One ``load_weights`` hand-over (see the module docstring).  Completed exactly once by
    the engine thread; trio tasks ``await wait()`` / ``await wait_released()``."""

    APPLIED, FAILED, SUPERSEDED, CLOSED = "applied", "failed", "superseded", "closed"

    def __init__(self, version: int) -> None:
        self.version = version
        self.outcome: str | None = None
        self.error: str = ""
        self.broken = False
        """True when the failure left the engine without usable weights (``EngineBroken``)."""
        self._lock = threading.Lock()
        self._wakers: list[Callable[[], None]] = []

    @property
    def released(self) -> bool:
        """True once the engine no longer reads the tensors it was handed."""
        return self.outcome is not None

    def complete(self, outcome: str, error: str = "", *, broken: bool = False) -> None:
        """Engine side: record the outcome and wake every waiter (first call wins)."""
        with self._lock:
            if self.outcome is not None:
                return
            self.error, self.broken = error, broken
            self.outcome = outcome
            wakers, self._wakers = self._wakers, []
        for wake in wakers:
            wake()

    async def wait_released(self) -> None:
        """Return once the swap is complete, whatever the outcome."""
        import trio

        with self._lock:
            if self.outcome is None:
                token = trio.lowlevel.current_trio_token()
                done = trio.Event()

                def wake() -> None:
                    try:
                        token.run_sync_soon(done.set)
                    except trio.RunFinishedError:
                        pass

                self._wakers.append(wake)
            else:
                done = None
        if done is not None:
            await done.wait()

    async def wait(self) -> None:
        """Return once applied; raise ``EngineBroken``/``EngineError`` for any other outcome."""
        await self.wait_released()
        if self.outcome == self.APPLIED:
            return
        if self.broken:
            raise EngineBroken(f"weights v{self.version}: {self.error}")
        raise EngineError(f"weights v{self.version} {self.outcome}" + (f": {self.error}" if self.error else ""))


@dataclass(frozen=True)
class GenerateRequest:
    """One turn's generation: continue ``prompt_ids``.

    ``stop_token_ids``: generation ends after sampling any of these (the stop token is
    included in the output, ``finish_reason="stop"``).  ``sampling.max_new_tokens`` caps
    the output (``finish_reason="length"``).  ``seed`` seeds this request's sampler (None:
    fresh entropy); the same seed and weights give the same tokens whatever the batch.
    """

    prompt_ids: Sequence[int]
    sampling: SamplingParams
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


@dataclass(frozen=True)
class GenerateResult:
    """What one request produced.

    ``token_ids`` [N] int32 sampled ids (ending with the stop token when
    ``finish_reason == "stop"``); ``logprobs`` [N] float32 behaviour log-prob of each;
    ``finish_reason`` one of ``stop``, ``length``, ``aborted``; ``policy_version`` see the
    module docstring; ``latency_s`` from submission to completion; ``token_versions`` [N]
    int32 the version that sampled each token (None when the engine does not track it:
    then every token has ``policy_version``).
    """

    token_ids: np.ndarray
    logprobs: np.ndarray
    finish_reason: str
    policy_version: int
    latency_s: float
    token_versions: np.ndarray | None = None

    def versions(self) -> np.ndarray:
        """[N] int32 per-token versions (``policy_version`` everywhere when untracked)."""
        if self.token_versions is not None:
            return self.token_versions
        return np.full(len(self.token_ids), self.policy_version, dtype=np.int32)


class Engine(Protocol):
    """Something that generates tokens.  See the module docstring for the contracts."""

    async def generate(self, req: GenerateRequest) -> GenerateResult: ...

    def load_weights(self, version: int, tensors: Mapping[str, "torch.Tensor"]) -> WeightSwap: ...

    @property
    def version(self) -> int: ...

    def stats(self) -> dict[str, float]: ...

    def close(self) -> None: ...

    def weights_digest(self, names: Sequence[str], dtype: str, algo: str) -> dict[str, int] | None:
        """``algo`` checksum of each named weight as ``dtype`` bytes, or None when the engine
        cannot read its weights back in the transfer layout (e.g. vLLM repacks them)."""

    def storage_dtypes(self, names: Sequence[str]) -> dict[str, "torch.dtype"]:
        """The dtype each named weight is stored in (when it differs from the transfer dtype
        the swap rounds it; ``mismatched_weights`` compares like with like)."""


def tensor_digest(tensors: Mapping[str, Any], dtype: str, algo: str) -> dict[str, int]:
    """``algo`` checksum of each tensor's bytes as ``dtype`` (torch tensors or numpy arrays)."""
    from turnscale.protocol import checksums

    out = {}
    for name, t in tensors.items():
        if hasattr(t, "detach"):  # torch: cast, then view the bytes (bf16 has no numpy dtype)
            import torch

            from turnscale.protocol.dtypes import torch_dtype

            t = t.detach().to("cpu", torch_dtype(dtype)) if t.is_floating_point() else t.detach().cpu()
            data = t.contiguous().view(torch.uint8).numpy()
        else:
            data = np.ascontiguousarray(t).view(np.uint8)
        out[name] = checksums.checksum(algo, data)
    return out


def mismatched_weights(engine: Any, tensors: Mapping[str, Any], dtype: str, algo: str) -> list[str] | None:
    """Names of the weights ``engine`` holds that differ from the pulled ``tensors`` (transfer
    ``dtype``), or None when the engine cannot read its weights back.

    Like is compared with like: an engine that stores a weight in another dtype than the
    transfer's (an hf engine in bfloat16 fed float32) holds the rounded values, so the pulled
    tensor is first cast to the engine's storage dtype (``Engine.storage_dtypes``), exactly as
    the swap did, and both sides are checksummed as ``dtype`` bytes."""
    digest = getattr(engine, "weights_digest", None)
    if digest is None:
        return None
    names = list(tensors)
    got = digest(names, dtype, algo)
    if got is None:
        return None
    stored = getattr(engine, "storage_dtypes", None)
    storage = stored(names) if stored is not None else {}
    as_stored = {n: (t.to(storage[n]) if n in storage and hasattr(t, "to") else t) for n, t in tensors.items()}
    want = tensor_digest(as_stored, dtype, algo)
    return [n for n in names if got.get(n) != want[n]]


# ----------------------------------------------------------------------------- bridge


_ids = itertools.count()


@dataclass(eq=False)
class Pending:
    """A request travelling from a trio task to an engine thread and back.

    The engine thread calls ``deliver`` exactly once (result or exception); the trio
    side sets ``aborted`` when its task is cancelled (read by the engine thread between
    steps; a plain bool write is atomic under the GIL).
    """

    req: GenerateRequest
    deliver: Callable[[Any], None]
    submitted: float = field(default_factory=time.monotonic)
    rid: int = field(default_factory=lambda: next(_ids))
    aborted: bool = False
    delivered: bool = False

    def finish(self, outcome: Any) -> None:
        if not self.delivered:
            self.delivered = True
            self.deliver(outcome)


async def bridge_call(submit: Callable[[Pending], None], req: GenerateRequest) -> GenerateResult:
    """Submit ``req`` to an engine thread (``submit`` must not block) and await the outcome.

    Cancellation of the awaiting trio task marks the request aborted and re-raises.
    """
    import trio

    token = trio.lowlevel.current_trio_token()
    done = trio.Event()
    box: list[Any] = []

    def deliver(outcome: Any) -> None:  # engine thread
        box.append(outcome)
        try:
            token.run_sync_soon(done.set)
        except trio.RunFinishedError:
            pass

    pending = Pending(req=req, deliver=deliver)
    submit(pending)
    try:
        await done.wait()
    except BaseException:
        pending.aborted = True
        raise
    outcome = box[0]
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


# ----------------------------------------------------------------------------- threaded base


class ThreadedEngine:
    """Skeleton of an engine with its own decoding thread and continuous batching.

    Subclasses implement ``_admit(list[Pending])`` (prefill joiners into the running
    batch), ``_step() -> list[tuple[Pending, GenerateResult]]`` (one decoding step of the
    whole batch; returns the requests that finished), ``_drop(list[Pending])`` (remove
    aborted requests), ``_active() -> list[Pending]``, ``_check_weights(tensors)`` and
    ``_apply_weights(tensors)``.  The loop, in order, each iteration: drop aborted
    requests; apply pending weights if at a safe point; admit queued requests (none while
    a between-turns swap waits for the batch to drain); one decoding step; deliver.
    """

    def __init__(self, *, max_batch: int, update_mode: str, version: int = 0, name: str = "engine") -> None:
        if update_mode not in ("between_turns", "inflight"):
            raise EngineError(f"update_mode {update_mode!r}: choose between_turns or inflight")
        self.max_batch = max_batch
        self.update_mode = update_mode
        self._version = version
        self._cond = threading.Condition()
        self._queue: collections.deque[Pending] = collections.deque()
        self._pending_weights: tuple[WeightSwap, Mapping[str, Any]] | None = None
        self._closed = False
        self.broken = ""
        """Why the engine refuses requests (a swap lost the previous weights); "" when healthy."""
        self._t0 = time.monotonic()
        self._busy_s = 0.0
        self._steps = 0
        self._occupancy_sum = 0.0
        self._tokens = 0
        self._finished = 0
        self._mid_batch_joins = 0
        self._weight_errors = 0
        self.last_weight_error = ""
        """Why the last weight swap failed (the engine keeps the previous version)."""
        self._thread = threading.Thread(target=self._run, name=f"{name}-loop", daemon=True)

    def _start(self) -> None:
        self._thread.start()

    # -- public API --------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        self._validate(req)
        return await bridge_call(self._submit, req)

    def _validate(self, req: GenerateRequest) -> None:
        if len(req.prompt_ids) == 0:
            raise EngineError("empty prompt: a request needs at least one prompt token")

    def _submit(self, p: Pending) -> None:
        with self._cond:
            if self._closed:
                p.finish(EngineClosed("engine is closed"))
                return
            if self.broken:
                p.finish(EngineBroken(f"engine is broken: {self.broken}; rebuild it"))
                return
            self._queue.append(p)
            self._cond.notify()

    @property
    def version(self) -> int:
        return self._version

    def load_weights(self, version: int, tensors: Mapping[str, Any]) -> WeightSwap:
        """Hand ``tensors`` over for version ``version`` (see the module docstring)."""
        self._check_weights(tensors)
        swap = WeightSwap(version)
        with self._cond:
            if self._closed:
                raise EngineClosed("engine is closed")
            if self.broken:
                raise EngineBroken(f"engine is broken: {self.broken}; rebuild it")
            older, self._pending_weights = self._pending_weights, (swap, tensors)
            self._cond.notify()
        if older is not None:
            older[0].complete(WeightSwap.SUPERSEDED)
        return swap

    def weights_digest(self, names: Sequence[str], dtype: str, algo: str) -> dict[str, int] | None:
        """See ``Engine.weights_digest``; engines that can read their weights override it."""
        return None

    def stats(self) -> dict[str, float]:
        wall = max(time.monotonic() - self._t0, 1e-9)
        with self._cond:
            queued = len(self._queue)
        return {
            "engine_busy": self._busy_s / wall,
            "engine_busy_s": self._busy_s,
            "tokens_generated": float(self._tokens),
            "requests_finished": float(self._finished),
            "batch_occupancy": (self._occupancy_sum / self._steps) if self._steps else 0.0,
            "decode_steps": float(self._steps),
            "mid_batch_joins": float(self._mid_batch_joins),
            "active": float(len(self._active())),
            "queued": float(queued),
            "policy_version": float(self._version),
            "weight_load_errors": float(self._weight_errors),
            "engine_broken": float(bool(self.broken)),
        }

    def close(self) -> None:
        """Stop the loop; queued and running requests finish as ``aborted`` with what they have."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            pending, self._pending_weights = self._pending_weights, None
            self._cond.notify_all()
        if pending is not None:
            pending[0].complete(WeightSwap.CLOSED)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    # -- loop --------------------------------------------------------------------------

    def _run(self) -> None:
        self._thread_init()
        try:
            while True:
                with self._cond:
                    while not self._closed and not self._queue and not self._active() and self._pending_weights is None:
                        self._cond.wait(timeout=1.0)
                    if self._closed:
                        break
                self._drop_aborted()
                self._maybe_apply_weights()
                joiners = self._take_joiners()
                t = time.monotonic()
                finished: list[tuple[Pending, GenerateResult]] = []
                try:
                    if joiners:
                        if self._active():
                            self._mid_batch_joins += len(joiners)
                        finished += self._admit(joiners)
                    if self._active():
                        n = len(self._active())
                        finished += self._step()
                        self._steps += 1
                        self._occupancy_sum += n / self.max_batch
                except Exception as exc:  # an engine bug must reach the callers, not kill the loop
                    err = EngineError(f"engine step failed: {type(exc).__name__}: {exc}")
                    for p in list(self._active()) + joiners:
                        p.finish(err)
                    self._reset_batch()
                self._busy_s += time.monotonic() - t
                for p, res in finished:
                    self._tokens += len(res.token_ids)
                    self._finished += 1
                    p.finish(res)
        finally:
            self._shutdown()

    def _take_joiners(self) -> list[Pending]:
        with self._cond:
            if self._pending_weights is not None and self.update_mode == "between_turns":
                return []
            room = self.max_batch - len(self._active())
            out = []
            while self._queue and room > 0:
                p = self._queue.popleft()
                if p.aborted:
                    p.finish(self._aborted_result(p))
                    continue
                out.append(p)
                room -= 1
            return out

    def _drop_aborted(self) -> None:
        gone = [p for p in self._active() if p.aborted]
        if gone:
            self._drop(gone)
            for p in gone:
                p.finish(self._aborted_result(p))

    def _maybe_apply_weights(self) -> None:
        with self._cond:
            pw = self._pending_weights
            if pw is None or (self.update_mode == "between_turns" and self._active()):
                return
            self._pending_weights = None
        swap, tensors = pw
        del pw
        try:
            self._apply_weights(tensors)
        except EngineBroken as exc:  # the previous weights are gone: refuse everything from now on
            del tensors
            self._weight_errors += 1
            self.last_weight_error = f"version {swap.version}: {exc}"
            self._break(str(exc))
            swap.complete(WeightSwap.FAILED, str(exc), broken=True)
            return
        except Exception as exc:  # keep serving the old version; the failure is visible in stats
            del tensors
            self._weight_errors += 1
            self.last_weight_error = f"version {swap.version}: {type(exc).__name__}: {exc}"
            swap.complete(WeightSwap.FAILED, f"{type(exc).__name__}: {exc}")
            return
        del tensors
        self._version = swap.version
        swap.complete(WeightSwap.APPLIED)

    def _break(self, why: str) -> None:
        """Engine thread: mark the engine broken and fail every queued and running request."""
        err = EngineBroken(f"engine is broken: {why}; rebuild it")
        with self._cond:
            self.broken = why
            queued = list(self._queue)
            self._queue.clear()
        for p in list(self._active()) + queued:
            p.finish(err)
        self._reset_batch()

    def _shutdown(self) -> None:
        with self._cond:
            queued = list(self._queue)
            self._queue.clear()
            pending, self._pending_weights = self._pending_weights, None
        if pending is not None:
            pending[0].complete(WeightSwap.CLOSED)
        for p in list(self._active()):
            p.finish(self._partial_result(p, FINISH_ABORTED))
        self._reset_batch()
        for p in queued:
            p.finish(self._aborted_result(p))

    def _make_result(self, p: Pending, ids: Any, logprobs: Any, versions: Any, reason: str) -> GenerateResult:
        """The one result shape of every engine: ``p`` sampled ``ids`` with behaviour
        ``logprobs``, token ``i`` under weights version ``versions[i]``; the policy version
        is the oldest of them (the current one when nothing was sampled)."""
        v = np.asarray(versions, dtype=np.int32)
        return GenerateResult(
            token_ids=np.asarray(ids, dtype=np.int32),
            logprobs=np.asarray(logprobs, dtype=np.float32),
            finish_reason=reason,
            policy_version=int(v.min()) if len(v) else self._version,
            latency_s=time.monotonic() - p.submitted,
            token_versions=v,
        )

    def _aborted_result(self, p: Pending) -> GenerateResult:
        return self._make_result(p, (), (), (), FINISH_ABORTED)

    def _row_result(self, row: Any, reason: str) -> GenerateResult:
        """The result of a running row (``row.p``, ``row.ids``, ``row.logprobs``, ``row.versions``)."""
        return self._make_result(row.p, row.ids, row.logprobs, row.versions, reason)

    # -- subclass hooks ----------------------------------------------------------------

    def _thread_init(self) -> None:
        """Runs first in the engine thread (thread-local settings such as inference mode)."""

    def _active(self) -> list[Pending]:
        raise NotImplementedError

    def _admit(self, joiners: list[Pending]) -> list[tuple[Pending, GenerateResult]]:
        raise NotImplementedError

    def _step(self) -> list[tuple[Pending, GenerateResult]]:
        raise NotImplementedError

    def _drop(self, gone: list[Pending]) -> None:
        raise NotImplementedError

    def _reset_batch(self) -> None:
        raise NotImplementedError

    def _row_of(self, p: Pending) -> Any | None:
        """Engine thread: ``p``'s running row (see ``_row_result``), or None when it has none."""
        return None

    def _partial_result(self, p: Pending, reason: str) -> GenerateResult:
        """What ``p`` produced so far, finishing with ``reason`` (aborted and empty when it has no row)."""
        row = self._row_of(p)
        return self._row_result(row, reason) if row is not None else self._aborted_result(p)

    def _check_weights(self, tensors: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def _apply_weights(self, tensors: Mapping[str, Any]) -> None:
        """Engine thread, at a safe point: make ``tensors`` the weights, all or nothing.

        Return only when the new weights are fully in place; raise a plain exception only
        when the previous weights are still intact, ``EngineBroken`` when they are not.  Keep
        no reference to ``tensors`` or their memory after returning or raising."""
        raise NotImplementedError
