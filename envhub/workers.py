"""Worker threads for env calls, each call under a deadline.

A Python thread cannot be killed, so a call that overruns its deadline is *abandoned*: the
awaiting request gets ``CallOverran`` at the deadline, and the thread keeps running until
the call returns on its own.  The work that can loop forever on client-chosen input (the
BabyAI oracle's bot) is bounded inside the env (``envhub.babyai_oracle``); this pool is the
backstop for everything else (a hung simulator, a stuck page load).

Invariants:
- At most ``threads`` calls are *live* (awaited by a request) at once; an abandoned call
  stops counting as live at its deadline, so its request and the instance lock are freed.
- The executor has ``threads + max_overrun`` threads, so up to ``max_overrun`` abandoned
  calls never take a live call's thread.  At ``max_overrun`` abandoned calls still running
  the pool is *exhausted*: ``call`` raises ``WorkersExhausted`` at once (the server answers
  503 and ``/health`` reports it) until one of them returns.
- Each call has an ``owner`` (the peer address of the request that started it; ``""`` for
  the server's own calls).  At ``max_overrun_per_owner`` abandoned calls of one owner still
  running, ``call`` raises ``OwnerOverran`` for that owner only: the others are served.  An
  owner's abandoned calls can still exceed its cap by the calls it had running when it
  reached it (at most ``threads``: a queued call is checked again when it gets its slot), so
  one owner alone never exhausts the pool while ``max_overrun >= max_overrun_per_owner +
  threads``.
- ``on_late(result_or_exc)`` of an abandoned call runs on the event loop once the call
  finally returns (the instance table closes the env there); it is never run for a call that
  finished in time.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

log = logging.getLogger("envhub")


class CallOverran(Exception):
    """The call did not finish within its deadline; it may still be running in its thread."""


class WorkersExhausted(Exception):
    """Too many abandoned calls still hold threads; no new call is started."""


class OwnerOverran(Exception):
    """This owner's abandoned calls still hold too many threads; no new call of its is started."""


class WorkerPool:
    """Runs blocking calls in threads; every public method runs on the event loop."""

    def __init__(self, threads: int, max_overrun: int, timeout_s: float, max_overrun_per_owner: int = 0) -> None:
        self.threads = threads
        self.max_overrun = max_overrun
        self.max_overrun_per_owner = max_overrun_per_owner or max_overrun
        self.timeout_s = timeout_s
        self.executor = ThreadPoolExecutor(max_workers=threads + max_overrun, thread_name_prefix="env")
        self._live: asyncio.Semaphore | None = None
        self.overrun = 0
        """Abandoned calls still running."""
        self.overrun_by: collections.Counter[str] = collections.Counter()
        """Abandoned calls still running, per owner (owners with none are not kept)."""
        self.overrun_total = 0
        """Calls ever abandoned."""

    @property
    def exhausted(self) -> bool:
        return self.overrun >= self.max_overrun

    async def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None,
                   on_late: Callable[[Future], None] | None = None, owner: str = "") -> Any:
        """``fn(*args)`` in a thread; its result, its exception, or ``CallOverran`` at the deadline.
        Refused with ``WorkersExhausted`` (pool exhausted) or ``OwnerOverran`` (``owner`` at
        its cap), checked on arrival and again once a live slot is free: calls queued for a
        slot are refused when their owner reached its cap meanwhile."""
        self._admit(owner)
        if self._live is None:
            self._live = asyncio.Semaphore(self.threads)
        async with self._live:
            self._admit(owner)
            loop = asyncio.get_running_loop()
            fut = loop.run_in_executor(self.executor, fn, *args)
            waiter = loop.create_future()  # done when fut is, or at the deadline (cheaper than wait_for + shield)
            fut.add_done_callback(lambda _f: waiter.done() or waiter.set_result(None))
            timer = loop.call_later(timeout_s or self.timeout_s, lambda: waiter.done() or waiter.set_result(None))
            try:
                await waiter
            except asyncio.CancelledError:  # the request was cancelled (shutdown): same as an overrun
                if not fut.done():
                    self._abandon(fut, on_late, owner)
                raise
            finally:
                timer.cancel()
            if not fut.done():
                self._abandon(fut, on_late, owner)
                raise CallOverran(f"did not finish within {timeout_s or self.timeout_s:g} s")
            return fut.result()

    def _admit(self, owner: str) -> None:
        if self.exhausted:
            raise WorkersExhausted(f"{self.overrun} env calls overran their deadline and still hold worker threads")
        if owner and self.overrun_by[owner] >= self.max_overrun_per_owner:
            raise OwnerOverran(f"{self.overrun_by[owner]} env calls from {owner} overran their deadline and still hold worker threads")

    def _abandon(self, fut: Future, on_late: Callable[[Future], None] | None, owner: str) -> None:
        self.overrun += 1
        self.overrun_by[owner] += 1
        self.overrun_total += 1
        fut.add_done_callback(lambda f: self._returned(f, on_late, owner))

    def _returned(self, fut: Future, on_late: Callable[[Future], None] | None, owner: str) -> None:
        self.overrun -= 1
        self.overrun_by[owner] -= 1
        if self.overrun_by[owner] <= 0:
            del self.overrun_by[owner]
        if not fut.cancelled() and fut.exception() is not None:
            log.info("an abandoned env call ended with %s", type(fut.exception()).__name__)
        if on_late is not None:
            try:
                on_late(fut)
            except Exception:
                log.exception("cleanup after an abandoned env call failed")

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Fire and forget (cleanup of abandoned instances); errors are logged."""
        def run() -> None:
            try:
                fn(*args)
            except Exception:
                log.exception("background env cleanup failed")
        try:
            self.executor.submit(run)
        except RuntimeError:  # shut down
            pass

    def shutdown(self) -> None:
        """Stop taking work; running calls are not waited for (abandoned threads may never end)."""
        self.executor.shutdown(wait=False, cancel_futures=True)
