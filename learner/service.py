"""The learner's event loop: control socket, announcements, training and publication.

One trio nursery holds four named tasks under ``LearnerService.serve``:

- ``control``: the ROUTER (``learner.port``).  Small requests are decoded, handled and
  answered before the next is read; large ones (groups) are checked and decoded off the
  loop, a bounded number at a time, then handled on it (``_control_loop``).  Handlers
  never await, so every state change is whole.  A bad message is logged and answered with
  ``ErrorReply`` (texts clipped); nothing a client sends can crash or stall the loop.
- ``announce``: re-publishes the current ``PolicyAnnouncement`` on PUB every
  ``announce_every_s`` so late subscribers catch it (PUB drops messages sent before a
  subscription exists).
- ``expiry``: expires leases whose deadline passed (their tasks are re-issued) and
  forgets actors silent for ``max(3 heartbeats, lease_ttl_s)`` (they must Hello again).
- ``train``: whenever ``groups_per_step`` accepted groups are ready, forms a batch
  (``LeaseManager.form_batch``: groups that became stale while they waited are dropped
  as ``stale`` and their tasks re-issued, so staleness holds *at training time*) and runs
  one optimizer step in a worker thread (``trio.to_thread.run_sync``), so control
  messages are answered while the model trains.  A step the trainer refused (non-finite
  loss or gradient: the weights are unchanged, ``step`` does not advance) is counted
  and neither publishes nor checkpoints; its groups' tasks are re-issued.  Groups the
  trainer dropped from a step for a non-finite value (``last_dropped``) are re-issued and
  written to the ledger as ``dropped_nonfinite``; the rest of the step trains.  Ordering
  after each step:

  1. the run's step advances (``RunState.advance``, as soon as the trainer's thread
     returns) and with it the turn limit for new leases (the schedule's limit at the new
     step: derived, never copied); the step's metrics are reduced and written — no await
     in between, so no request is answered half-way;
  2. every ``publish_every`` steps: granting pauses, the state dict is gathered and
     handed to the weight publisher (its own thread and socket), *then* ``version``
     advances (``RunState.publish``: admission and staleness checks read it from there),
     *then* the announcement goes out, *then* granting resumes — so no lease ever names a
     version whose weights cannot be pulled, nor an outdated turn limit or version;
  3. every ``checkpoint_every`` steps (and after the last) a checkpoint is written
     with the run state (``RunState.state``: step, version, run id, trained groups) and
     the task cursor and lease state in ``extra`` (not the turn limit: it follows from
     the step and the schedule; an old checkpoint's ``turn_limit`` is ignored).  A group
     taken out of the buffer stays in ``in_hand`` until its step is accounted for, so
     every checkpoint (also SIGTERM's, ``learner.main.checkpoint_and_stop``) holds each
     acknowledged group as trained, or as a task to re-issue (buffered, in hand, leased).

State: ``self.run`` (``learner.runstate.RunState``) owns step, version, run id,
incarnation and trained groups, and derives the turn limit; ``self.leases`` owns the
task cursor, live leases and admission counter and reads version and turn limit from
``self.run``.  Nothing else holds a copy.

Intake (``_group``): the group is validated and, when accepted, buffered *before*
anything is written about it; a trajectory-log failure costs the log line (counted as
``rollout/trajlog_errors``), never the group.  The buffer entry records the sender's pool,
so each trained group's staleness and behaviour-vs-learner log-prob gap
(``learner.poolgap``) count under that pool even if the actor has left by then.

Identity: ``run_id`` names the run (kept across resumes); ``incarnation`` names this
learner process (new on every start, sent in every ``PolicyAnnouncement``), so actors
drop weights that a previous incarnation published under the same version numbers.

Scaling (``ControlRequest`` -> ``LearnerStatus``, from a controller such as
``turnscale.scaling``): ``self.control`` (``learner.control.ControlHandler``) drains actors,
sets the lease limit per actor and answers the signals; its docstring states the order (a
drained actor gets no new lease, its in-flight groups are trained, then it is told
``Shutdown("drained")``).  This loop asks it on every ``LeaseRequest`` and ``Heartbeat``
and feeds its ``ScalingSignals`` from intake and training.

Shutdown: after ``learner.steps`` steps the service publishes ``Shutdown`` (a few times;
PUB is lossy) and from then on answers every ``Hello``, ``LeaseRequest`` and ``Heartbeat``
with ``Shutdown`` too, so an actor that missed the announcements (a slow subscriber, or
one reconnecting at that moment) still learns the run is over on its next request.  It
keeps serving until every registered actor has said ``Goodbye`` (or been told on a
``Hello``, or forgotten as silent), at most ``linger_s``, and returns.

The trainer, publisher and checkpointer are injected (``TrainerLike`` ...) so the loop
is tested with fakes; ``learner.main`` wires the real ones.
"""

from __future__ import annotations

import ctypes
import logging
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np
import trio
import zmq

from turnscale.conf.schema import Config
from turnscale.learner import relaytree
from turnscale.learner.control import ControlHandler
from turnscale.learner.leases import LeaseManager, Ready, reported_progress
from turnscale.learner.runstate import RunState
from turnscale.learner.screen import Screen, ScreenFailed, check_bounds
from turnscale.learner.signal import SignalWatch
from turnscale.learner.registry import ActorRegistry, short
from turnscale.learner.metrics import NullLogger, StepMetrics, record_actor_stats, record_intake, record_train, record_trained
from turnscale.learner.poolgap import GroupGap, PoolGroup, record_pool_gaps
from turnscale.learner.tasks import TaskStream, parse_task_spec
from turnscale.learner.trajlog import NullTrajectoryLog
from turnscale.learner.validation import GroupLimits
from turnscale.protocol import codec
from turnscale.protocol.errors import ProtocolError, TooManyFrames, TransportError, clip
from turnscale.protocol.messages import (
    ControlRequest,
    SCHEMA_VERSION,
    EnvEndpoint,
    ErrorReply,
    Goodbye,
    GroupAck,
    Heartbeat,
    HeartbeatAck,
    Hello,
    LeaseGrant,
    LeaseRequest,
    PolicyAnnouncement,
    SamplingParams,
    Shutdown,
    TrajectoryGroup,
    WeightManifest,
    Welcome,
)
from turnscale.protocol.transport import AsyncSocket, CurveKeys, SocketLimits, configure, split_router_frames, tcp_endpoint

log = logging.getLogger("turnscale.learner")


INLINE_DECODE_BYTES = 64 << 10
"""Control messages under this many bytes (frames added up) are decoded on the control loop
itself (at most a few ms, whatever they hold); larger ones in a worker thread."""
HEADER_BYTES_PER_TOKEN = 64
"""Header bytes a legal group may use per token it can hold (measured: ~20 with inline
arrays and 4.5 bytes of text per token); sets ``learner.max_header_mb``'s default."""
TRIM_AFTER_HEADER_BYTES = 256 << 10
"""After decoding a header at least this large, return freed heap to the OS (``_malloc_trim``)."""

SUSPECT_HEARTBEATS = 2.5
"""A relay silent for this many heartbeat intervals is left out of other actors' sources."""


class TrainerLike(Protocol):
    step: int
    last_group_gaps: Sequence[GroupGap]
    """Per group of the last ``train_step``, in batch order (``learner.poolgap``); a trainer
    reporting fewer entries than groups gets no per-pool gap metrics for that step."""

    def train_step(self, groups: Sequence[TrajectoryGroup]) -> dict[str, float]: ...


class PublisherLike(Protocol):
    def publish(self, version: int, state_dict: Mapping[str, Any]) -> WeightManifest: ...

    def close(self) -> None: ...


class CheckpointerLike(Protocol):
    def save(self, step: int, extra: dict[str, Any]) -> None:
        """Atomically write model/optimizer/RNG state plus ``extra`` for ``step``."""

    def load_latest(self) -> dict[str, Any] | None:
        """Restore the trainer from the newest checkpoint; its ``extra``, or None if there is none."""


class ScheduleLike(Protocol):
    def limit_at(self, step: int) -> int: ...


@dataclass
class ServiceParts:
    """Everything the loop needs besides the config (real in ``main``, fakes in tests)."""

    trainer: TrainerLike
    publisher: PublisherLike
    weights: Callable[[], Mapping[str, Any]]
    """Returns the state dict to publish (already cast to the transfer dtype)."""
    schedule: ScheduleLike
    checkpointer: CheckpointerLike | None = None
    logger: Any = field(default_factory=NullLogger)
    trajlog: Any = field(default_factory=NullTrajectoryLog)
    model_path: str = ""
    vocab_size: int = 0
    """Rows of the model's input embedding: received token ids must be below it (0: unchecked)."""
    curve: CurveKeys | None = None
    """CURVE server keys for the control ROUTER and the PUB (``common.curve.learner_curve(...).server()``);
    None: plain TCP.  Clients are checked by the ZAP authenticator running on ``context``."""
    context: zmq.Context | None = None
    """The ZeroMQ context to open the sockets on (the one the ZAP authenticator serves);
    None: the service makes (and terminates) its own."""


class LearnerService:
    """See the module docstring for tasks and ordering."""

    announce_every_s: float = 2.0
    linger_s: float = 10.0
    """Longest wait at shutdown for registered actors to say goodbye."""

    def __init__(self, cfg: Config, parts: ServiceParts) -> None:
        self.cfg = cfg
        self.parts = parts
        lc = cfg.learner
        self.tasks = parse_task_spec(cfg.env.tasks.train, cfg.env.name, "train")
        self.run = RunState(parts.schedule, step=parts.trainer.step)
        """Step, version, run id, incarnation, trained groups; the turn limit (see the module docstring)."""
        self.leases = LeaseManager(
            stream=TaskStream(self.tasks, seed=lc.seed), group_size=cfg.algo.group_size,
            groups_per_step=lc.groups_per_step, max_staleness=lc.max_staleness, ttl_s=lc.lease_ttl_s,
            publish_every=lc.publish_every, progress_timeout_s=lc.lease_progress_timeout_s, seed=lc.seed, policy=self.run,
            limits=GroupLimits(vocab_size=parts.vocab_size, max_tokens=cfg.sampling.max_context_tokens,
                               max_abs_reward=lc.max_abs_reward),
        )
        self.buffer: list[Ready] = []
        """Accepted groups waiting for a batch, in arrival order."""
        self.in_hand: list[Ready] = []
        """The batch taken out of ``buffer`` and not yet accounted for (waiting for the train
        lock, or training): ``checkpoint_extra`` counts it as untrained, so an acknowledged
        group is always trained, buffered, in hand or re-issued, whatever the moment of a stop."""
        self._limits = self._control_limits()
        """Control-socket limits (``_control_limits``); a larger message is refused unread."""
        self.publishing = False
        """True while a publication is in progress: no leases are granted meanwhile."""
        self.manifest: WeightManifest | None = None
        self.actors = ActorRegistry(max_actors=lc.max_actors, silent_s=3 * lc.heartbeat_interval_s,
                                    max_ids_per_connection=lc.max_actor_ids_per_connection,
                                    max_ids_per_key=lc.max_actor_ids_per_key)
        """Registered actors, each bound to its connection (``learner.registry``)."""
        self.metrics = StepMetrics()
        self.signal = SignalWatch()  # warns when almost every group has equal rewards (no RL signal)
        self.stopping = False
        self.done = False
        self._have_groups = trio.Event()
        self._last_step_end = time.monotonic()
        self._generated_seen = 0.0
        self._pool_generated_seen: dict[str, float] = {}
        self._ctx: zmq.Context | None = None
        self.train_lock = trio.Lock()
        """Held while a step trains, publishes and checkpoints (a signal handler saving a
        checkpoint takes it, so it never saves a model mid-update)."""
        self.last_checkpoint_step = -1
        self.ready = trio.Event()
        """Set once sockets are bound and version 0 (or the resumed version) is published."""
        self.control = ControlHandler(self.actors, self.leases, self.run, lc.max_leases_per_actor)
        """Drains, the lease limit per actor and the scaling signals (``learner.control``)."""
        self.scaling_signals = self.control.signals
        """Cumulative scaling signals (``LearnerStatus``), written by intake and training."""

    # ------------------------------------------------------------------ state (read from self.run)
    @property
    def step(self) -> int:
        return self.run.step

    @property
    def version(self) -> int:
        return self.run.version

    @property
    def turn_limit(self) -> int:
        return self.run.turn_limit

    @property
    def run_id(self) -> str:
        return self.run.run_id

    @property
    def incarnation(self) -> str:
        return self.run.incarnation

    @property
    def trained_groups(self) -> int:
        return self.run.trained_groups

    def announcement(self) -> PolicyAnnouncement:
        seg = getattr(self.parts.publisher, "segment_ref", None)  # test fakes have none
        ref = seg(self.version) if seg is not None and self.manifest is not None else None
        return PolicyAnnouncement(version=self.version, step=self.step, manifest=self.manifest,
                                  incarnation=self.incarnation, shm_path=ref.path if ref else "",
                                  shm_token=ref.token if ref else "")

    def restore(self) -> bool:
        """Resume from the newest checkpoint (``learner.resume``); True when one was found."""
        ck = self.parts.checkpointer
        extra = ck.load_latest() if ck is not None else None
        if extra is None:
            return False
        self.run.load(extra, trainer_step=self.parts.trainer.step)
        self.last_checkpoint_step = self.step
        self.leases.load_state(extra["leases"], self.tasks)
        log.info("resumed at step %d, version %d, turn limit %d", self.step, self.version, self.turn_limit)
        return True

    def checkpoint_extra(self) -> dict[str, Any]:
        """The run's state for a checkpoint: every accepted group not yet trained (the batch in
        hand, then the buffer) and every live lease has its task re-issued on resume.  Taken
        under ``train_lock`` (a step is either wholly in ``trained_groups`` or wholly not)."""
        untrained = [r.lease.task for r in (*self.in_hand, *self.buffer)]
        return {**self.run.state(), "leases": self.leases.state(self.trained_groups, untrained=untrained)}

    # ------------------------------------------------------------------ serve
    async def serve(self) -> None:
        lc = self.cfg.learner
        own_ctx = self.parts.context is None
        self._ctx = zmq.Context() if own_ctx else self.parts.context
        curve = self.parts.curve
        router = AsyncSocket(configure(self._ctx.socket(zmq.ROUTER), SocketLimits(max_message_bytes=self._limits.max_message_bytes),
                                       curve, server=True))
        router.sock.bind(tcp_endpoint(lc.host, lc.port))
        pub = configure(self._ctx.socket(zmq.PUB), curve=curve, server=True)
        pub.bind(tcp_endpoint(lc.host, lc.pub_port))
        self._pub = AsyncSocket(pub)
        try:
            await self._publish_weights(self.version)
            self.ready.set()
            log.info("learner %s ready: control %s (%s), version %d, step %d/%d", self.run_id,
                     tcp_endpoint(lc.host, lc.port), "CURVE" if curve is not None else "plain TCP, no CURVE",
                     self.version, self.step, lc.steps)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._control_loop, router, name="control")
                nursery.start_soon(self._announce_loop, name="announce")
                nursery.start_soon(self._expiry_loop, name="expiry")
                await self._train_loop()
                await self._shutdown()
                nursery.cancel_scope.cancel()
        finally:
            router.close()
            self._pub.close()
            if own_ctx:
                self._ctx.term()

    async def _publish_weights(self, version: int) -> None:
        """Gather, cast and publish ``version``; ``weights/publish_s`` is the time it took
        (under ``learner.strategy=fsdp`` the gather runs a layer at a time on every rank)."""
        self.publishing = True
        try:
            t0 = time.monotonic()
            sd = await trio.to_thread.run_sync(self.parts.weights)
            self.manifest = await trio.to_thread.run_sync(self.parts.publisher.publish, version, sd)
            self.metrics.add("weights/publish_s", time.monotonic() - t0, "last")
            self._record_egress()
            self.run.publish(version)
            await self._announce()
        finally:
            self.publishing = False

    def _record_egress(self) -> None:
        """Learner egress of each weight version retired by the last publish: the bytes its
        publisher served for that version over its whole life, late pulls included
        (``weights/learner_egress_copies``: in copies of the weights; with relays about
        ``learner.relay.fanout``, without them one per actor).  Reported when the version
        can no longer be pulled: the publisher keeps two versions, so one publish later."""
        take = getattr(self.parts.publisher, "take_retired_egress", None)
        if take is None:
            return
        for version, served, total in take():
            if total:
                self.metrics.add("weights/learner_egress_bytes", served, "sum")
                self.metrics.add("weights/learner_egress_copies", served / total, "max")
                log.info("weights v%d: learner egress %d bytes (%.2f copies)", version, served, served / total)

    async def _announce(self) -> None:
        try:
            await self._pub.send_msg(self.announcement())
        except TransportError as exc:  # PUB never blocks; a closed socket at shutdown is fine
            log.debug("announce failed: %s", exc)

    async def _announce_loop(self) -> None:
        while True:
            await trio.sleep(self.announce_every_s)
            await self._announce()

    async def _expiry_loop(self) -> None:
        period = max(0.05, min(1.0, self.cfg.learner.lease_ttl_s / 4))
        while True:
            await trio.sleep(period)
            now = trio.current_time()
            self.leases.expire(now)
            for lease in self.leases.take_expired():
                self.metrics.add("rollout/leases_expired", 1, "sum")
                log.info("lease %s (task %s) expired; re-issued", lease.lease_id, lease.task.data_idx)
            silent = max(3 * self.cfg.learner.heartbeat_interval_s, self.cfg.learner.lease_ttl_s)
            for a in self.actors.silent(now, silent):
                self.actors.drop(a.actor_id)  # its leases expire on their own; it must Hello again
                log.info("actor %s silent for %.0fs; forgotten", short(a.actor_id), now - a.last_seen)

    # ------------------------------------------------------------------ training
    async def _train_loop(self) -> None:
        lc = self.cfg.learner
        gps = lc.groups_per_step
        while self.step < lc.steps:
            batch = await self._next_batch(gps)
            async with self.train_lock:
                if lc.debug_step_delay_s > 0:
                    await trio.sleep(lc.debug_step_delay_s)  # tests/benchmarks: a slow learner
                before = self.step
                await self._train_one(batch)
                if self.step == before:
                    continue  # refused (non-finite) or nothing trainable: same weights, nothing to publish
                if self.step % lc.publish_every == 0:
                    await self._publish_weights(self.version + 1)
                if self.step % lc.checkpoint_every == 0 or self.step >= lc.steps:
                    await self.save_checkpoint()

    async def _next_batch(self, size: int) -> list[Ready]:
        """Wait for ``size`` groups that are fresh at the current version (see ``form_batch``).
        The batch moves from ``buffer`` to ``in_hand`` in one synchronous statement (no await
        between), so a checkpoint always sees each accepted group in one of them."""
        while True:
            batch, self.buffer, stale = self.leases.form_batch(self.buffer, size)
            self.in_hand = batch
            for r in stale:
                self.metrics.add("rollout/groups_dropped/stale", 1, "sum")
                self._ledger(r, "stale", self.step + 1)
                log.info("group %s (sampled at v%d) dropped as stale at v%d; task %s re-issued", r.lease.lease_id,
                         r.oldest, self.version, r.lease.task.data_idx)
            self.scaling_signals.groups_stale += len(stale)
            if batch:
                return batch
            self._have_groups = trio.Event()
            self.scaling_signals.waiting_since = t0 = trio.current_time()
            try:
                await self._have_groups.wait()
            finally:
                self.scaling_signals.waiting_since = None
                self.scaling_signals.idle_s += trio.current_time() - t0

    def _ledger(self, r: Ready, outcome: str, step: int) -> None:
        """One line per group that left the ready buffer for optimizer step ``step`` (1-based):
        trained in it, or dropped."""
        try:
            self.parts.trajlog.write_batch_entry(r.group, step=step, version=self.version,
                                                 staleness=self.version - r.oldest, outcome=outcome)
        except Exception as exc:  # the log line is lost, never the data
            self.metrics.add("rollout/trajlog_errors", 1, "sum")
            log.warning("training ledger write failed for %s: %s", r.lease.lease_id, exc)

    async def save_checkpoint(self) -> None:
        """Checkpoint the current step (once per step; no-op without a checkpointer)."""
        if self.parts.checkpointer is None or self.last_checkpoint_step == self.step:
            return
        extra = self.checkpoint_extra()
        await trio.to_thread.run_sync(self.parts.checkpointer.save, self.step, extra)
        self.last_checkpoint_step = self.step

    async def _train_one(self, ready: list[Ready]) -> None:
        """One step on ``ready`` (``in_hand``) under ``train_lock``; from the trainer's return to
        ``in_hand`` emptied there is no await, so no checkpoint sees the batch both trained
        (``trained_groups``) and untrained (``in_hand``)."""
        batch = [r.group for r in ready]
        t0 = time.monotonic()
        before = self.step
        out = await trio.to_thread.run_sync(self.parts.trainer.train_step, batch)
        t1 = time.monotonic()
        self.in_hand = []
        m = self.metrics
        record_train(m, out)
        gaps = list(self.parts.trainer.last_group_gaps)
        dropped = getattr(self.parts.trainer, "last_dropped", None) or {}  # trainers may not drop groups
        for i in sorted(dropped):  # a non-finite value: not trained, the rest were (or the step refused)
            r = ready[i]
            self.leases.untrain(r, reissue=True)
            self._ledger(r, "dropped_nonfinite", before + 1)
            m.add("train/groups_dropped/nonfinite", 1, "sum")
            log.warning("group %s from actor %s dropped from step %d (non-finite %s); task %s re-issued",
                        short(r.lease.lease_id), short(r.group.actor_id), before + 1, short(str(dropped[i])),
                        r.lease.task.data_idx)
        if dropped:
            keep = [i for i in range(len(ready)) if i not in dropped]
            gaps = [gaps[i] for i in keep] if len(gaps) == len(ready) else []
            ready = [ready[i] for i in keep]
            batch = [r.group for r in ready]
        if self.parts.trainer.step == before:  # refused: non-finite loss/gradient, or nothing trainable
            why = "nonfinite" if out.get("train/nonfinite") else "empty"
            m.add(f"train/steps_skipped/{why}", 1, "sum")
            for r in ready:  # their admission slots come back (else a synchronous run would stall)
                self.leases.untrain(r, reissue=why == "nonfinite")  # valid data: play the task again
                self._ledger(r, f"skipped_{why}", before + 1)
            log.warning("step %d not taken (%s); the weights are unchanged", self.step + 1, why)
            return
        self.run.advance(self.parts.trainer.step, len(batch))  # the turn limit moves with it
        tokens = sum(int(np.asarray(ep.loss_mask).sum()) for g in batch for ep in g.episodes)
        wall = max(t1 - self._last_step_end, 1e-9)
        if len(gaps) != len(ready):
            gaps = [None] * len(ready)
        record_pool_gaps(m, [PoolGroup(r.pool, self.version - r.oldest, gap) for r, gap in zip(ready, gaps)])
        for r in ready:
            self._ledger(r, "trained", self.step)
            record_trained(m, r.group, self.version - r.oldest)
            self.scaling_signals.groups_trained += 1
            self.scaling_signals.staleness_sum += max(0, self.version - r.oldest)
            warning = self.signal.observe([ep.reward for ep in r.group.episodes], [ep.success for ep in r.group.episodes])
            if warning:
                log.warning("%s", warning)
        m.add("rollout/equal_reward_frac", self.signal.fraction, "last")
        m.add("perf/step_time_s", t1 - t0, "last")
        m.add("perf/tokens_trained", tokens, "sum")
        m.add("perf/tokens_trained_per_s", tokens / max(t1 - t0, 1e-9), "last")
        m.add("perf/learner_busy", (t1 - t0) / wall, "last")
        m.add("perf/groups_per_s", len(batch) / wall, "last")
        m.add("perf/version", self.version, "last")
        m.add("perf/actors", len(self.actors), "last")
        self._record_actor_stats(m, wall)
        m.add("perf/leases_in_flight", self.leases.in_flight, "last")
        m.add("rollout/turn_limit", max(g.turn_limit for g in batch), "last")
        m.add("rollout/trained_groups_total", self.trained_groups, "last")
        record_actor_stats(m, [a.stats for a in self.actors.values()])
        self._last_step_end = t1
        self.parts.logger.write(self.step, m.reduce())

    def _record_actor_stats(self, m: StepMetrics, wall: float) -> None:
        """From the actors' latest heartbeats: generation throughput and engine busy fraction,
        in all and per pool (``pool/<name>/actors``, ``.../tokens_generated_per_s``,
        ``.../weight_pull_s_mean``: seconds per weight pull, from the actors' counters)."""
        total = sum(a.stats.get("tokens_generated", 0.0) for a in self.actors.values())
        m.add("perf/tokens_generated_per_s", max(0.0, total - self._generated_seen) / wall, "last")
        self._generated_seen = total
        pools: dict[str, list[Any]] = {}
        for a in self.actors.values():
            pools.setdefault(a.pool, []).append(a)
        for name, members in pools.items():
            gen = sum(a.stats.get("tokens_generated", 0.0) for a in members)
            seen = self._pool_generated_seen.get(name, gen)  # a pool's first step: no rate yet
            self._pool_generated_seen[name] = gen
            m.add(f"pool/{name}/actors", len(members), "last")
            m.add(f"pool/{name}/tokens_generated_per_s", max(0.0, gen - seen) / wall, "last")
            pulls = sum(a.stats.get("weight_pulls", 0.0) for a in members)
            if pulls:
                m.add(f"pool/{name}/weight_pull_s_mean", sum(a.stats.get("weight_pull_s", 0.0) for a in members) / pulls, "last")
        busy = [a.stats["engine_busy"] for a in self.actors.values() if "engine_busy" in a.stats]
        if busy:
            m.add("perf/actor_engine_busy", sum(busy) / len(busy), "last")

    async def _shutdown(self) -> None:
        self.stopping = True
        for _ in range(3):
            try:
                await self._pub.send_msg(Shutdown(reason="done"))
            except TransportError:
                break
            await trio.sleep(0.1)
        with trio.move_on_after(self.linger_s):
            while len(self.actors):  # Goodbye, a Hello told Shutdown, or the expiry loop empties it
                await trio.sleep(0.05)
        if len(self.actors):
            log.info("stopping without goodbye from %d actor(s)", len(self.actors))
        self.done = True

    # ------------------------------------------------------------------ control
    async def _control_loop(self, router: AsyncSocket) -> None:
        """Serve the control ROUTER: no message, however built, holds it up for long.

        - A message of more than ``learner.max_frames`` frames is dropped while it is
          received (never kept nor decoded) and answered ``bad_message``.
        - A small message (under ``INLINE_DECODE_BYTES``: every ``Hello``, ``LeaseRequest``,
          ``Heartbeat``) is decoded, handled and answered here, before the next is read.
        - A larger one (a trajectory group) is queued to ``_decode_worker``, which has it
          checked by a child process (``learner.screen``: a dense header holds the GIL
          while it parses), decodes it in a worker thread if it passed, and handles and
          answers it on the trio thread; the loop reads on meanwhile.  The queue is
          bounded: at most ``learner.decode_queue`` messages wait besides the one being
          decoded, and one per connection; a message past either bound is answered at
          once with a retryable ``ErrorReply(code="busy")`` and dropped, so a flood from
          one peer never queues unbounded work.

        ``handle`` runs only on the trio thread and never awaits, so every state change is
        whole and in the order messages are handled (a large message is handled once
        decoded, after small ones that arrived later; an actor waits for each reply
        before its next request, so its own requests stay in order)."""
        send, recv = trio.open_memory_channel(self.cfg.learner.decode_queue)
        waiting: set[bytes] = set()
        """Connections with a large message queued or being decoded."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._decode_worker, router, recv, waiting, name="control-decode")
            while True:
                got = await self._receive(router)
                if got is None:
                    continue
                prefix, body = got
                if sum(len(f) for f in body) < INLINE_DECODE_BYTES:
                    try:
                        msg = self._decode_now(body)
                    except ProtocolError as exc:
                        msg = exc
                    await self._send_reply(router, prefix, self._reply_to(msg, prefix[0]))
                elif (refused := self._over_size(body)) is not None:  # refused unread, never queued
                    await self._send_reply(router, prefix, self._reply_to(refused, prefix[0]))
                elif prefix[0] in waiting:
                    await self._send_reply(router, prefix, _busy("this connection already has a large message "
                                                                 "waiting to be decoded"))
                else:
                    try:
                        send.send_nowait((prefix, body))
                    except trio.WouldBlock:
                        await self._send_reply(router, prefix, _busy(f"{self.cfg.learner.decode_queue} large "
                                                                     "messages are already waiting to be decoded"))
                        continue
                    waiting.add(prefix[0])
                del got, body

    async def _receive(self, router: AsyncSocket) -> tuple[list[bytes], list[Any]] | None:
        """The next routable message as (reply prefix, message frames); None when it was
        refused (too many frames: answered) or unroutable (dropped)."""
        limit = self._limits.max_frames
        try:
            frames = await router.recv_multipart(max_frames=limit + 2)  # + identity and request id
        except TooManyFrames as exc:
            text = f"message has {exc.count - 2} frames, over the learner's limit of {limit} (learner.max_frames)"
            log.warning("bad message: %s", text)
            if len(exc.head) == 2:
                await self._send_reply(router, exc.head, ErrorReply(code="bad_message", message=text))
            return None
        try:
            got = split_router_frames(frames)
        except ProtocolError as exc:
            log.warning("dropping unroutable message: %s", clip(str(exc)))
            return None
        self.actors.note_peer(got[0][0], got[1])  # the connection's CURVE key, for Hello (ids per key)
        return got

    async def _decode_worker(self, router: AsyncSocket, recv: trio.MemoryReceiveChannel, waiting: set[bytes]) -> None:
        """Check (child process), decode (worker thread), handle and answer (trio thread)
        the queued large messages, one at a time (see ``_control_loop``).  A check that
        fails to run is answered ``busy`` (retryable); the child is restarted for the next."""
        screen = Screen(self._limits, self.cfg.learner.max_leases_per_actor)
        try:
            async for prefix, body in recv:
                try:
                    problem = await trio.to_thread.run_sync(screen.check, body, abandon_on_cancel=True)
                    msg = ProtocolError(problem) if problem else await self._decode(body)
                except ProtocolError as exc:
                    msg = exc
                except ScreenFailed as exc:
                    log.warning("large message not checked: %s", exc)
                    msg = None
                del body  # the frames go as soon as the record holds what it needs
                reply = _busy("its check failed") if msg is None else self._reply_to(msg, prefix[0])
                del msg
                waiting.discard(prefix[0])
                await self._send_reply(router, prefix, reply)
        finally:
            screen.close()

    def _reply_to(self, msg: Any, identity: bytes) -> Any:
        """The reply to a decoded message, or to the ``ProtocolError`` its decoding raised.
        Error texts are clipped (``protocol.errors.clip``) in replies and log lines alike."""
        try:
            if isinstance(msg, ProtocolError):
                raise msg
            return self.handle(msg, identity)
        except ProtocolError as exc:
            text = clip(str(exc))
            log.warning("bad message: %s", text)
            return ErrorReply(code="bad_message", message=text)
        except Exception as exc:  # a handler bug: log it, answer, keep serving
            log.error("error handling %s: %s\n%s", type(msg).__name__, clip(f"{type(exc).__name__}: {exc}"),
                      "".join(traceback.format_tb(exc.__traceback__)).rstrip())
            return ErrorReply(code="internal", message=f"learner error ({type(exc).__name__}); see the learner log", retryable=True)

    async def _send_reply(self, router: AsyncSocket, prefix: list[bytes], reply: Any) -> None:
        try:
            await router.send_msg(reply, prefix=prefix)
        except TransportError as exc:
            log.warning("could not reply: %s", clip(str(exc)))

    async def _decode(self, body: list[Any]) -> Any:
        """Decode a large control message in a worker thread (``_decode_now`` there), so
        the control loop answers others meanwhile; then hand freed heap back to the OS."""
        return await trio.to_thread.run_sync(self._decode_then_trim, body)

    def _decode_then_trim(self, body: list[Any]) -> Any:
        """``_decode_now``; then, after a large header, ``_malloc_trim``."""
        try:
            return self._decode_now(body)
        finally:
            if len(body[0]) >= TRIM_AFTER_HEADER_BYTES:
                _malloc_trim()

    def _over_size(self, body: list[Any]) -> ProtocolError | None:
        """The error for a message over the learner's byte limits (nothing decoded), or None."""
        size = sum(len(f) for f in body)
        if size > self._limits.max_message_bytes:
            return ProtocolError(f"message is {size} bytes, over the learner's limit of {self._limits.max_message_bytes} "
                                 f"(learner.max_message_mb)")
        if len(body[0]) > self._limits.max_header_bytes:
            return ProtocolError(f"header frame is {len(body[0])} bytes, over the learner's limit of "
                                 f"{self._limits.max_header_bytes} (learner.max_header_mb)")
        return None

    def _decode_now(self, body: list[Any]) -> Any:
        """Decode a control message within the control limits (``_control_limits``), then
        check the learner's own bounds on it; ``ProtocolError`` when anything is over."""
        refused = self._over_size(body)  # before any decoding
        if refused is not None:
            raise refused
        msg = codec.decode(body, self._limits)
        check_bounds(msg, self.cfg.learner.max_leases_per_actor)
        return msg

    def _control_limits(self) -> codec.Limits:
        """Control-socket limits.  Messages up to ``learner.max_message_mb`` (a group is a
        few MB of arrays); headers up to ``learner.max_header_mb`` or, when 0, what a legal
        group needs with room to spare: ``HEADER_BYTES_PER_TOKEN`` per token the group can
        hold (``algo.group_size * sampling.max_context_tokens``), at least 1 MiB.  A header
        is what decoding expands into Python objects (up to ~60x its bytes), so its cap
        bounds the memory and the time (GIL) one decode takes."""
        lc = self.cfg.learner
        mb = int(lc.max_message_mb * (1 << 20))
        header = int(lc.max_header_mb * (1 << 20)) or max(
            1 << 20, HEADER_BYTES_PER_TOKEN * self.cfg.algo.group_size * self.cfg.sampling.max_context_tokens)
        return codec.Limits(max_message_bytes=mb, max_array_bytes=mb, max_header_bytes=min(mb, header),
                            max_frames=lc.max_frames)

    def handle(self, msg: Any, identity: bytes = b"") -> Any:
        """Answer one decoded request from the connection ``identity`` (pure state change +
        reply; no awaits).  Requests naming an actor must come from its bound connection."""
        now = trio.current_time()
        if self.stopping and isinstance(msg, (Hello, LeaseRequest, Heartbeat)):
            return self._told_shutdown(msg, identity)
        if isinstance(msg, ControlRequest):
            return self.control.handle(msg, ready_groups=len(self.buffer))
        if isinstance(msg, Hello):
            return self._hello(msg, identity, now)
        if isinstance(msg, LeaseRequest):
            return self._lease_request(msg, identity, now)
        if isinstance(msg, TrajectoryGroup):
            return self._group(msg, identity, now)
        if isinstance(msg, Heartbeat):
            a = self.actors.bound(msg.actor_id, identity)
            if a is None:
                return _not_registered()
            if reported_progress(a.stats, msg.stats):  # generation moved: its leases' progress deadline too
                self.leases.progress(msg.actor_id, now)
            a.last_seen, a.policy_version, a.stats = now, msg.policy_version, dict(msg.stats)
            drained = self.control.heartbeat_gate(a, msg.lease_ids)
            if drained is not None:
                return drained
            sources = self.weight_sources(msg.actor_id)
            return HeartbeatAck(unknown_lease_ids=self.leases.heartbeat(msg.actor_id, msg.lease_ids, now),
                                weight_sources=sources, weight_source_keys=self.relay_keys(sources),
                                relay_clients=self.relay_clients(msg.actor_id))
        if isinstance(msg, Goodbye):
            if self.actors.bound(msg.actor_id, identity) is None:
                return _not_registered()
            released = self.leases.release_actor(msg.actor_id)
            self.actors.drop(msg.actor_id)
            self.control.forget(msg.actor_id)  # it no longer contends for a share
            log.info("actor %s left (%s); %d lease(s) released", short(msg.actor_id), short(msg.reason or "no reason"),
                     len(released))
            return GroupAck(lease_id="", accepted=True)
        return ErrorReply(code="bad_message", message=f"{type(msg).__name__} is not a request the learner answers")

    def _told_shutdown(self, msg: Hello | LeaseRequest | Heartbeat, identity: bytes) -> Shutdown:
        """The run is over: the reliable copy of the published ``Shutdown``.  An actor whose
        ``Hello`` is answered so will not say goodbye (it never registered again), so its
        earlier registration is dropped when the Hello is its own (same token)."""
        if isinstance(msg, Hello):
            old = self.actors.actors.get(msg.actor_id)
            if old is not None and (old.identity == identity or (msg.token and msg.token == old.token)):
                self.actors.drop(msg.actor_id)
        else:
            a = self.actors.bound(msg.actor_id, identity)
            if a is not None:
                a.last_seen = trio.current_time()
        return Shutdown(reason="done")

    def _hello(self, msg: Hello, identity: bytes, now: float) -> Any:
        if msg.schema_version != SCHEMA_VERSION:
            return ErrorReply(code="bad_message", message=f"schema {msg.schema_version} != {SCHEMA_VERSION}; upgrade the older side")
        info, error, ended = self.actors.register(msg, identity, now)
        if error is not None:
            log.warning("Hello from %s refused: %s", short(msg.actor_id), error.code)
            return error
        for aid in ended:  # the id's earlier session, or a silent id of the same client
            released = self.leases.release_actor(aid)
            self.control.forget(aid)
            log.info("actor %s %s; %d lease(s) released", short(aid),
                     "re-registered" if aid == msg.actor_id else f"silent, replaced by {short(msg.actor_id)}",
                     len(released))
        log.info("actor %s registered (%s pid %d, %s on %s)", short(msg.actor_id), short(msg.host), msg.pid,
                 short(msg.engine), short(msg.device))
        lc, s = self.cfg.learner, self.cfg.sampling
        return Welcome(
            run_id=self.run_id, actor_id=msg.actor_id, model_path=self.parts.model_path,
            renderer=self.cfg.model.renderer,
            sampling=SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                    max_new_tokens=s.max_new_tokens, max_context_tokens=s.max_context_tokens),
            envs=[EnvEndpoint(name=self.cfg.env.name, url=self.cfg.env.base_url, flavor=self.cfg.env.client_flavor)],
            transfer_dtype=lc.transfer_dtype, pub_endpoint=tcp_endpoint(lc.host, lc.pub_port),
            weights_endpoint=tcp_endpoint(lc.host, lc.weights_port),
            heartbeat_interval_s=lc.heartbeat_interval_s, policy=self.announcement(),
            weight_sources=(sources := self.weight_sources(msg.actor_id)), weight_source_keys=self.relay_keys(sources),
            relay_clients=self.relay_clients(msg.actor_id),
        )

    def weight_sources(self, actor_id: str) -> list[str]:
        """The relays ``actor_id`` asks for weight chunks before the learner (``learner/relaytree.py``):
        none when relays are off or the actor serves no relay itself (e.g. it shares the learner's host)."""
        rc = self.cfg.learner.relay
        if not rc.enabled:
            return []
        # A relay that missed heartbeats is not offered (a pull from it would cost a timeout
        # per version) long before the actor is forgotten (lease_ttl_s); it is again once heard.
        quiet = SUSPECT_HEARTBEATS * self.cfg.learner.heartbeat_interval_s
        now = trio.current_time()
        me = self.actors.actors.get(actor_id)
        if me is None:
            return []
        # A CURVE relay is named only once its owner has been told this actor's key: before
        # that it refuses the handshake, and libzmq never reconnects a refused DEALER.
        ids = [a.actor_id for a in self.actors.values()
               if a.relay_endpoint and (a is me or (now - a.last_seen <= quiet
                                                    and (not a.relay_public_key or a.told >= me.serial)))]
        if actor_id not in ids:
            return []
        eps = [self.actors.actors[a].relay_endpoint for a in ids]
        return relaytree.sources(eps, ids.index(actor_id), rc.fanout, rc.fallback_hops)

    def relay_clients(self, actor_id: str) -> list[str]:
        """Who may pull from ``actor_id``'s CURVE relay: the public keys of the other registered
        actors that serve a CURVE relay (and so pull with that key pair; the learner admitted
        each of them through ZAP).  Empty when relays are off or its relay is plain.  Called
        for the reply that tells it (``Welcome``/``HeartbeatAck``): records ``told``."""
        me = self.actors.actors.get(actor_id)
        if not self.cfg.learner.relay.enabled or me is None or not me.relay_public_key:
            return []
        me.told = self.actors.registrations  # what it is told now covers every registration so far
        return sorted({a.relay_public_key for a in self.actors.values() if a.relay_public_key and a.actor_id != actor_id})

    def relay_keys(self, endpoints: list[str]) -> list[str]:
        """The CURVE public key of each relay endpoint ("" for a plain relay), in order."""
        keys = {a.relay_endpoint: a.relay_public_key for a in self.actors.values() if a.relay_endpoint}
        return [keys.get(ep, "") for ep in endpoints]

    def _lease_request(self, msg: LeaseRequest, identity: bytes, now: float) -> Any:
        a = self.actors.bound(msg.actor_id, identity)
        if a is None:
            return _not_registered()
        a.last_seen = now
        gate = self.control.lease_gate(a)  # a draining actor: nothing new, then Shutdown("drained")
        if gate is not None:
            return gate
        if self.stopping or msg.max_leases < 1:
            return LeaseGrant(leases=[], retry_after_s=1.0)
        if self.publishing:
            return LeaseGrant(leases=[], retry_after_s=0.1)
        want = self.control.ask(a, msg.max_leases, now)  # its room: never past its fair share while others ask
        revoked = self.control.reclaim(a, want, now)  # leases others hold past their share, when it waits
        if revoked:
            self.metrics.add("rollout/leases_revoked", len(revoked), "sum")
        leases = self.leases.grant(msg.actor_id, want, now)
        for lease in leases:
            log.info("lease %s (task %s, turn limit %d, version %d) granted to actor %s", lease.lease_id,
                     lease.task.data_idx, lease.turn_limit, lease.policy_version, short(msg.actor_id))
        return LeaseGrant(leases=leases, retry_after_s=0.0 if len(leases) == msg.max_leases else 0.5)

    def _group(self, group: TrajectoryGroup, identity: bytes, now: float) -> Any:
        a = self.actors.bound(group.actor_id, identity)
        if a is None:  # another connection speaking for this actor (or a forgotten one): change nothing
            return _not_registered()
        a.last_seen = now
        live = self.leases.live.get(group.lease_id)
        lease_s = now - live.issued_at if live is not None else -1.0
        r = self.leases.intake(group, now)
        record_intake(self.metrics, r.accepted, r.reason)
        self.scaling_signals.groups_received += 1
        self.scaling_signals.groups_stale += int(r.reason == "stale")
        if r.accepted:  # buffer first: from here on the group is owned by the learner
            self.buffer.append(self.leases.ready(group, r, pool=a.pool))
            if len(self.buffer) >= self.cfg.learner.groups_per_step:
                self._have_groups.set()
        elif r.reason == "invalid":
            log.warning("group %s from actor %s dropped as invalid: %s", short(group.lease_id), short(group.actor_id), r.problem)
        else:
            log.info("group %s from %s dropped: %s", short(group.lease_id), short(group.actor_id), r.reason)
        try:  # log second: a failure here costs the log line, never the group
            self.parts.trajlog.write_group(group, step=self.step, version=self.version, accepted=r.accepted,
                                           drop_reason=r.reason, lease_s=lease_s)
        except Exception as exc:
            self.metrics.add("rollout/trajlog_errors", 1, "sum")
            log.warning("trajectory log write failed for group %s: %s: %s", group.lease_id, type(exc).__name__, exc)
        return GroupAck(lease_id=group.lease_id, accepted=r.accepted, reason=r.reason)


def _busy(why: str) -> ErrorReply:
    return ErrorReply(code="busy", retryable=True,
                      message=f"learner busy: {why}; send it again in a moment (learner.decode_queue)")


def _malloc_trim(min_interval_s: float = 1.0) -> None:
    """Hand the heap's free memory back to the OS (glibc ``malloc_trim``; a no-op
    elsewhere), at most once per ``min_interval_s``.  A large header decodes into many
    small objects; once they are freed, glibc keeps the pages unless asked, and RSS would
    stay at a flood's peak.  (ctypes releases the GIL for the call.)"""
    global _trimmed_at
    now = time.monotonic()
    if _LIBC is not None and now - _trimmed_at >= min_interval_s:
        _trimmed_at = now
        _LIBC.malloc_trim(0)


def _load_libc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _load_libc()
_trimmed_at = 0.0


def _not_registered() -> ErrorReply:
    return ErrorReply(code="not_registered", retryable=True,
                      message="this connection has not registered that actor id: send Hello first (the learner restarted?)")
