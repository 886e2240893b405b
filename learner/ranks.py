"""A learner job of several ranks (``torchrun --nproc_per_node=K -m turnscale learner ...``).

Rank 0 runs the whole learner service (``learner.service``: sockets, leases, validation,
staleness, weight publication, checkpoints, metrics) with a ``RankedTrainer`` in place of
its ``Trainer``; ranks 1..K-1 (followers) run only a ``Trainer`` in ``follow``.  Under
``learner.strategy=ddp`` every rank holds a full replica of the model (``accelerate``):
rank 0 alone publishes weights and writes checkpoints, which need no collective.  Under
``fsdp`` (``learner.fsdp``) each rank holds a shard of every parameter, gradient and
optimizer state: the step is the same share protocol (FSDP's reduce-scatter takes the place
of DDP's all-reduce), and rank 0 starts publication and checkpoints on every rank with
``RankCollective`` (below).  accelerate's own FSDP and DeepSpeed are refused with a clear error.

Rank 0 talks to the followers over ``RankChannel``: protocol records encoded by
``protocol.codec`` into one frame, sent over torch.distributed on a gloo group of its own
as a length (``[1] int64``) then the bytes (``[n] uint8``) — never pickle.  The order:

1. ``RankStart(model_path)`` before any ``Trainer`` is built (rank 0 resolves, or builds,
   the model folder; every rank loads that one);
2. ``RankResume(path)`` when rank 0 resumes from a checkpoint: every rank loads the
   same trainer state (DDP broadcast the initial weights only; optimizer state is per rank);
3. per optimizer step, ``RankShare`` to each follower: rank 0 splits the step's groups by
   tokens (``split_by_tokens``: whole groups, never split), sends each follower its share,
   then every rank runs ``Trainer.train_step`` on its share (the DDP step; the trainer's
   invariant of equal forward/backward counts holds whatever the shares), then one
   all-reduce on the channel group sums each group's behaviour-gap sums into rank 0's
   ``last_group_gaps`` (per-pool metrics over the whole batch);
4. ``fsdp`` only, between steps: ``RankCollective(kind="publish")`` when the service
   publishes: every rank gathers the weights one tensor at a time in state-dict order
   (``fsdp.gathered_state``) while rank 0 writes each into the publication buffer as it
   arrives (``RankedTrainer.state_dict_for_publish``: a lazy mapping, gathered as the
   publisher reads it; no second full copy); ``RankCollective(kind="checkpoint", path)``
   when it checkpoints: every rank writes its shards into rank 0's temp folder
   (``checkpoint.save_sharded``);
5. ``RankStop(reason)`` when rank 0's service ends, normally or not; followers exit.
   Followers ignore SIGTERM (``learner.main``): on ``scancel`` torchrun passes it to every
   rank, rank 0 finishes its step, checkpoints and sends ``RankStop``; torchrun SIGKILLs
   whatever is left after its grace period.

While rank 0 waits for groups its keep-alive thread sends ``RankPing`` whenever the
channel was quiet for a quarter of ``learner.rank_timeout_s`` (the channel group's gloo
timeout), so a follower's wait for the next record never times out while rank 0 lives
(gloo cannot wait longer than its timeout, nor poll a pending receive).  One lock
serialises the channel: a step, a resume, a ping, the stop.

Failures: a follower that dies closes its gloo connections, so rank 0's next send or
collective raises (a ping while idle, or the next step) and rank 0 fails with
``RankError`` naming the rank; a follower that neither dies nor answers is given up after
``learner.rank_timeout_s`` with the same error.  A follower whose rank 0 is gone fails
its wait the same way, within ``learner.rank_timeout_s``.  Under torchrun, the first
rank to exit ends the job.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch

from turnscale.learner.poolgap import GroupGap
from turnscale.protocol import codec
from turnscale.protocol.errors import TurnscaleError
from turnscale.protocol.messages import (RankCollective, RankPing, RankResume, RankShare, RankStart, RankStop,
                                         TrajectoryGroup)

log = logging.getLogger("turnscale.learner")

__all__ = ["RankChannel", "RankError", "RankedTrainer", "connect", "follow", "split_by_tokens"]

_NO_OUT_OF_BAND = 1 << 62
"""``codec.encode(out_of_band_bytes=...)``: every array inline, so a record is one frame."""

class RankError(TurnscaleError):
    """A learner rank died, or did not take its part of a step in time."""


def split_by_tokens(tokens: Sequence[int], world: int) -> list[list[int]]:
    """Indices of the step's groups for each of ``world`` ranks, balanced by ``tokens``
    (each group's token count): largest group first to the least-loaded rank (ties: lower
    rank).  Groups are never split; each share keeps batch order.  With fewer groups than
    ranks some shares are empty (those ranks train zero-weight micro-batches)."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    load = [0] * world
    shares: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(tokens)), key=lambda i: (-int(tokens[i]), i)):
        r = min(range(world), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += int(tokens[i])
    return [sorted(s) for s in shares]


def group_tokens(group: TrajectoryGroup) -> int:
    """Tokens of all episodes of ``group`` (what a rank's forward computes)."""
    return sum(len(ep.token_ids) for ep in group.episodes)


class RankChannel:
    """Codec records between rank 0 and the followers on a gloo group of their own
    (see the module docstring).  ``limits`` bound what a follower accepts."""

    def __init__(self, group: Any, rank: int, world: int, limits: codec.Limits) -> None:
        self.group, self.rank, self.world, self.limits = group, rank, world, limits

    def send(self, dst: int, msg: Any) -> None:
        """Rank 0: ``msg`` to follower ``dst``; ``RankError`` when it cannot take it."""
        import torch.distributed as dist

        frames = codec.encode(msg, out_of_band_bytes=_NO_OUT_OF_BAND)
        if len(frames) != 1:
            raise AssertionError(f"{type(msg).__name__} encoded to {len(frames)} frames; expected one")
        data = torch.from_numpy(np.frombuffer(bytes(frames[0]), dtype=np.uint8).copy())
        try:
            dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst, group=self.group)
            dist.send(data, dst, group=self.group)
        except (RuntimeError, dist.DistError) as exc:
            raise _lost(dst, f"sending it {type(msg).__name__}", exc) from exc

    def recv(self) -> Any:
        """Follower: the next record from rank 0 (at most ``learner.rank_timeout_s``: rank 0
        pings idle followers well within it)."""
        import torch.distributed as dist

        n = torch.zeros(1, dtype=torch.int64)
        dist.recv(n, 0, group=self.group)
        size = int(n[0])
        if not 0 < size <= self.limits.max_message_bytes:
            raise RankError(f"rank 0 announced a {size}-byte message; the limit is {self.limits.max_message_bytes} "
                            f"(learner.max_message_mb)")
        data = torch.empty(size, dtype=torch.uint8)
        dist.recv(data, 0, group=self.group)
        return codec.decode([data.numpy().tobytes()], self.limits,
                            expect=(RankStart, RankResume, RankShare, RankStop, RankPing, RankCollective))

    def broadcast(self, msg: Any) -> None:
        """Rank 0: ``msg`` to every follower."""
        for dst in range(1, self.world):
            self.send(dst, msg)

    def sum_gaps(self, gaps: Sequence[GroupGap], indices: Sequence[int], total: int,
                 dropped: Iterable[int] = ()) -> tuple[list[GroupGap], set[int]]:
        """Every rank: its groups' gap sums (``gaps[k]`` for batch position ``indices[k]``)
        all-reduced into one list over the whole batch, and the batch positions of the groups
        any rank's trainer dropped as non-finite (``dropped``: positions ``k`` in this rank's
        share).  One collective.  The gap list is [] when any rank reports none, as
        ``algo=sft`` does; the dropped set is complete either way, so rank 0 re-issues every
        dropped group's task, whichever rank dropped it."""
        import torch.distributed as dist

        t = torch.zeros(total + 1, 4, dtype=torch.float64)
        if len(gaps) == len(indices):
            for i, g in zip(indices, gaps):
                t[i, :3] = torch.tensor([g.tokens, g.abs_gap_sum, g.weight_sum], dtype=torch.float64)
        else:
            t[total, 0] = 1.0  # this rank has no gaps
        for k in dropped:
            t[indices[k], 3] = 1.0
        try:
            dist.all_reduce(t, group=self.group)
        except (RuntimeError, dist.DistError) as exc:
            raise _lost(None, "summing the step's per-group metrics", exc) from exc
        gone = {i for i in range(total) if t[i, 3] > 0}
        if t[total, 0] > 0:
            return [], gone
        return [GroupGap(*map(float, row[:3])) for row in t[:total]], gone


def _distributed_failure(exc: BaseException) -> bool:
    """Whether ``exc`` came from a collective with a lost rank (gloo and NCCL raise plain
    ``RuntimeError`` naming themselves, or torch's ``DistError``)."""
    import torch.distributed as dist

    text = str(exc)
    return isinstance(exc, dist.DistError) or "gloo" in text or "NCCL" in text or "HCCL" in text


def _lost(rank: int | None, doing: str, exc: BaseException) -> RankError:
    who = f"learner rank {rank}" if rank is not None else "a learner rank"
    return RankError(f"{who} failed while rank 0 was {doing}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}. "
                     f"A follower rank died or hung (learner.rank_timeout_s); its own log (torchrun prints each rank's "
                     f"exit) says why.  Restart the job with learner.resume=true to continue from the last checkpoint.")


def connect(cfg: Any) -> RankChannel | None:
    """The channel of a learner started under torchrun with several ranks (``WORLD_SIZE`` >
    1), after initialising torch.distributed the way accelerate does; None for one rank."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    import torch.distributed as dist
    from accelerate import PartialState

    PartialState(cpu=cfg.learner.device.partition(":")[0] == "cpu")  # initialises the default group
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.learner.rank_timeout_s))
    mb = int(cfg.learner.max_message_mb * (1 << 20)) * max(1, cfg.learner.groups_per_step)
    limits = codec.Limits(max_message_bytes=mb, max_array_bytes=mb, max_header_bytes=mb)
    return RankChannel(group, dist.get_rank(), dist.get_world_size(), limits)


class RankedTrainer:
    """Rank 0's trainer of a multi-rank learner: ``service.TrainerLike`` over every rank
    (see the module docstring); everything else is the local ``Trainer``'s."""

    def __init__(self, trainer: Any, channel: RankChannel, timeout_s: float) -> None:
        kind = str(trainer.accelerator.distributed_type).upper()
        if "FSDP" in kind or "DEEPSPEED" in kind:
            raise RankError(f"accelerate runs {kind}; the learner shards with learner.strategy=fsdp itself. "
                            f"Launch with torchrun (or accelerate launch without FSDP/DeepSpeed).")
        self.trainer, self.channel = trainer, channel
        self.last_group_gaps: list[GroupGap] = []
        self.last_dropped: dict[int, str] = {}
        """Groups of the last step that any rank's trainer dropped as non-finite, by index in
        the whole batch (followers' drops arrive through ``RankChannel.sum_gaps``)."""
        self._lock = threading.Lock()
        """Held while rank 0 uses the channel: a step, a resume, a ping, the stop."""
        self._last_sent = time.monotonic()
        self._failed: RankError | None = None
        self._closed = threading.Event()
        self._ping_every_s = timeout_s / 4
        threading.Thread(target=self._keepalive, name="rank-keepalive", daemon=True).start()

    @property
    def step(self) -> int:
        return self.trainer.step

    def __getattr__(self, name: str) -> Any:  # tokenizer, hf_model, state_writer, ...
        return getattr(self.trainer, name)

    def train_step(self, groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
        """One optimizer step on ``groups`` across all ranks.  The trainer's ``loss/*`` and
        ``perf/*`` metrics are rank 0's share's (the service's ``perf/tokens_trained`` and
        the per-pool gaps cover the whole batch); ``perf/learner_ranks`` counts the ranks."""
        shares = split_by_tokens([group_tokens(g) for g in groups], self.channel.world)
        with self._lock:
            self._check()
            for dst in range(1, self.channel.world):
                self.channel.send(dst, RankShare(step=self.trainer.step, total_groups=len(groups), indices=shares[dst],
                                                 groups=[groups[i] for i in shares[dst]]))
            try:
                out = self.trainer.train_step([groups[i] for i in shares[0]])
            except RuntimeError as exc:
                if not _distributed_failure(exc):  # e.g. out of memory: rank 0's own error, as it is
                    raise
                raise _lost(None, "training a step (DDP)", exc) from exc
            mine = getattr(self.trainer, "last_dropped", {})
            self.last_group_gaps, gone = self.channel.sum_gaps(self.trainer.last_group_gaps, shares[0], len(groups), mine)
            own = {shares[0][i]: why for i, why in mine.items()}
            self.last_dropped = {i: own.get(i, "a non-finite value (dropped on a follower rank; its log says which)")
                                 for i in sorted(gone | set(own))}
            self._last_sent = time.monotonic()
        out["perf/learner_ranks"] = float(self.channel.world)
        return out

    def state_dict_for_publish(self, dtype: str, *, copy: bool = True) -> Mapping[str, torch.Tensor]:
        """Replicated: rank 0's state dict (no collective).  Sharded: a ``GatheredState`` that
        gathers on every rank as it is read (read it at once, to the end; one reading)."""
        if not getattr(self.trainer, "sharded", False):
            return self.trainer.state_dict_for_publish(dtype, copy=copy)
        return GatheredState(self, dtype)

    def state_writer(self) -> Any:
        """Replicated: rank 0's writer.  Sharded: ``write(dir)`` that has every rank write its
        shards into ``dir`` (``RankCollective(kind="checkpoint")``) and writes rank 0's."""
        if not getattr(self.trainer, "sharded", False):
            return self.trainer.state_writer()
        own = self.trainer.state_writer()

        def write(path: str) -> None:
            with self._lock:
                self._check()
                self.channel.broadcast(RankCollective(kind="checkpoint", step=self.trainer.step, path=path))
                self._collective("writing a checkpoint", own, path)
                self._last_sent = time.monotonic()
        return write

    def gather(self, dtype: str) -> Iterator[tuple[str, torch.Tensor]]:
        """Sharded: ``(name, whole tensor)`` in state-dict order, gathered with every rank
        (``RankCollective(kind="publish")``).  The channel is held from the first gather to
        the last, and released before the last tensor is handed out: a reader that stops
        pulling once it has every tensor (``zip`` with the names does) leaves nothing held.
        One tensor is gathered ahead of the one handed out (two whole tensors at most).  A
        reader that stops early still gets the remaining gathers run (discarded): the
        followers run them all."""
        from turnscale.learner import fsdp

        self._lock.acquire()
        held = True
        try:
            self._check()
            self.channel.broadcast(RankCollective(kind="publish", step=self.trainer.step, dtype=dtype))
            items = fsdp.gathered_state(self.trainer.model, dtype)
            pending = self._collective("gathering the weights", next, items, None)
            while pending is not None:
                following = self._collective("gathering the weights", next, items, None)
                if following is None:
                    self._last_sent = time.monotonic()
                    self._lock.release()
                    held = False
                try:
                    yield pending
                except GeneratorExit:
                    if held:
                        for _ in items:  # keep in step with the followers
                            pass
                    raise
                pending = following
        finally:
            if held:
                self._last_sent = time.monotonic()
                self._lock.release()

    def _collective(self, doing: str, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, a collective: a lost rank's error as ``RankError``."""
        try:
            return fn(*args)
        except RuntimeError as exc:
            if not _distributed_failure(exc):
                raise
            raise _lost(None, doing, exc) from exc

    def load_state(self, path: str) -> int:
        """Resume every rank from the checkpoint at ``path`` (sharded: a collective, so the
        channel is held until it is done)."""
        with self._lock:
            self._check()
            self.channel.broadcast(RankResume(path=path))
            if getattr(self.trainer, "sharded", False):
                step = self._collective("loading a checkpoint", self.trainer.load_state, path)
                self._last_sent = time.monotonic()
                return step
            self._last_sent = time.monotonic()
        return self.trainer.load_state(path)

    def stop(self, reason: str) -> None:
        """Tell every follower to exit; a follower already gone is only logged."""
        self._closed.set()
        with self._lock:
            if self._failed is not None:
                return
            for dst in range(1, self.channel.world):
                try:
                    self.channel.send(dst, RankStop(reason=reason))
                except RankError as exc:
                    log.warning("could not stop learner rank %d: %s", dst, exc)

    async def watch(self) -> None:
        """Raise the keep-alive's ``RankError`` (checked every half second) so the service
        stops at once when a follower is lost while it waits for groups."""
        import trio

        while True:
            await trio.sleep(0.5)
            self._check()

    def _check(self) -> None:
        if self._failed is not None:
            raise self._failed

    def _keepalive(self) -> None:
        """``RankPing`` to every follower when the channel has been quiet for a quarter of
        ``learner.rank_timeout_s`` (rank 0 waiting for groups), so a follower's wait never
        times out while rank 0 lives, and a follower that died is noticed while idle (the
        next step raises its ``RankError``)."""
        while not self._closed.wait(min(1.0, self._ping_every_s)):
            with self._lock:
                if self._failed is not None or self._closed.is_set():
                    return
                if time.monotonic() - self._last_sent < self._ping_every_s:
                    continue
                try:
                    self.channel.broadcast(RankPing(step=self.trainer.step))
                except RankError as exc:
                    self._failed = exc
                    log.error("%s", exc)
                    return
                self._last_sent = time.monotonic()


class GatheredState(Mapping[str, torch.Tensor]):
    """The weights of a sharded (``fsdp``) learner as the weight publisher reads them:
    ``items()``/``keys()``/``[name]`` give the whole tensors' names, shapes and dtypes without
    gathering (``fsdp.state_shapes``: enough for ``protocol.weights.layout``); ``values()``
    gathers them one at a time with every rank (``RankedTrainer.gather``), cast to ``dtype``
    on CPU, so the publisher writes each into its buffer as it arrives and rank 0's extra
    memory is two tensors (one gathered ahead).  Read ``values()`` once."""

    def __init__(self, ranked: RankedTrainer, dtype: str) -> None:
        from turnscale.learner import fsdp

        self._ranked, self._dtype = ranked, dtype
        self._shapes = dict(fsdp.state_shapes(ranked.trainer.model))

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._shapes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)

    def values(self) -> Iterator[torch.Tensor]:  # type: ignore[override]
        for name, t in self._ranked.gather(self._dtype):
            yield t


def follow(cfg: Any, channel: RankChannel) -> int:
    """A follower rank: build the trainer ``RankStart`` names, then train each share until
    ``RankStop``; returns the exit code (0)."""
    from turnscale.learner.trainer import Trainer

    start = channel.recv()
    if not isinstance(start, RankStart):
        raise RankError(f"rank {channel.rank}: expected RankStart first, got {type(start).__name__}")
    if start.world_size != channel.world:
        raise RankError(f"rank 0 counts {start.world_size} ranks, this rank {channel.world}")
    trainer = Trainer(cfg, start.model_path)
    log.info("learner rank %d/%d ready (%s)", channel.rank, channel.world, start.model_path)
    while True:
        msg = channel.recv()
        if isinstance(msg, RankStop):
            log.info("learner rank %d stops (%s) at step %d", channel.rank, msg.reason, trainer.step)
            return 0
        if isinstance(msg, RankPing):
            continue
        if isinstance(msg, RankResume):
            trainer.load_state(msg.path)
            log.info("learner rank %d resumed from %s at step %d", channel.rank, msg.path, trainer.step)
        elif isinstance(msg, RankCollective):
            _join_collective(trainer, msg, channel.rank)
        elif isinstance(msg, RankShare):
            if msg.step != trainer.step:
                raise RankError(f"rank {channel.rank} is at step {trainer.step}, rank 0 at {msg.step}")
            trainer.train_step(msg.groups)
            channel.sum_gaps(trainer.last_group_gaps, msg.indices, msg.total_groups, trainer.last_dropped)
            for k, why in trainer.last_dropped.items():
                log.warning("learner rank %d dropped group %d of step %d: %s", channel.rank, msg.indices[k], msg.step + 1, why)
        else:
            raise RankError(f"rank {channel.rank}: unexpected {type(msg).__name__}")


def _join_collective(trainer: Any, msg: RankCollective, rank: int) -> None:
    """A follower's part of rank 0's publication or checkpoint (sharded trainers only)."""
    if not getattr(trainer, "sharded", False):
        raise RankError(f"rank {rank}: RankCollective({msg.kind}) needs learner.strategy=fsdp on every rank")
    if msg.step != trainer.step:
        raise RankError(f"rank {rank} is at step {trainer.step}, rank 0 at {msg.step}")
    if msg.kind == "publish":
        from turnscale.learner import fsdp

        for _ in fsdp.gathered_state(trainer.model, msg.dtype):
            pass
    elif msg.kind == "checkpoint":
        trainer.state_writer()(msg.path)
    else:
        raise RankError(f"rank {rank}: unknown RankCollective kind {msg.kind!r}")
