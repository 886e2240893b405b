"""``turnscale learner [hydra overrides]`` / ``python -m turnscale.learner``: build the parts, run the loop.

``run(cfg)`` reads top to bottom: resolved config -> ``<learner.dir>/config.yaml``, model path -> trainer -> schedule -> weight publisher ->
checkpointer -> loggers -> service (-> resume) -> serve.  Everything the loop does is in
``learner.service``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any, Callable, Iterable

from turnscale.conf.schema import Config

log = logging.getLogger("turnscale.learner")

EnvPlay = Callable[[Any, int], Iterable[str]]
"""``(env config, episodes) -> texts``: the env played in-process (``envhub.corpus.play_texts``)."""

FALLBACK_CORPUS = [
    "Your goal: go to the red ball. You see a wall 3 steps forward. Available actions: [turn left, turn right, move forward]",
    "Thought: I should move toward the goal.\nAction: move forward",
    "Crafting commands:\ncraft 4 oak planks using 1 oak log\n\nGoal: craft stick.",
    "<search> who wrote the book </search> <information> Doc 1(Title: t) text </information> <answer> yes </answer>",
]


def env_corpus(cfg: Config, episodes: int = 24, play: EnvPlay | None = None) -> list[str]:
    """Text for the tiny model's tokenizer: a few fixed lines, the actors' instruction prompt,
    and the env's own observations from a few episodes played in-process by ``play``.

    ``play`` (``envhub.corpus.play_texts``) is handed in by the application (``turnscale
    learner``, benchmarks): roles never import each other, so the learner does not import
    envhub.  Without it (``python -m turnscale.learner``) the corpus is the fixed lines and the prompt."""
    texts: list[str] = list(FALLBACK_CORPUS)
    try:
        from turnscale.common.prompts import instruction

        texts.append(instruction(cfg.env.name))
    except (ImportError, ValueError):
        pass
    if play is not None:
        texts.extend(play(cfg.env, episodes))
    return texts


def resolve_model_path(cfg: Config, play: EnvPlay | None = None) -> str:
    """``learner.init_from`` when set, else ``model.path`` (``tiny``: built once and cached,
    on ``env_corpus(cfg, play=play)``)."""
    if cfg.learner.init_from:
        return cfg.learner.init_from
    from turnscale.common.tinymodel import ensure_model

    return ensure_model(cfg.model, lambda: env_corpus(cfg, play=play))


class TrainerCheckpointer:
    """``service.CheckpointerLike``: one checkpoint folder per step (``learner.checkpoint``)
    holding the trainer's part (``Trainer.state_writer``: model, optimizer, RNG, its
    optimizer-step counter) and, beside it, the run's state that the service hands in
    (``extra``: ``RunState``, task cursor, leases) plus the schedule's state.  ``schedule``
    may be None (SFT has none)."""

    def __init__(self, trainer: Any, root: str, schedule: Any, keep: int) -> None:
        self.trainer, self.root, self.schedule, self.keep = trainer, root, schedule, keep

    def save(self, step: int, extra: dict[str, Any]) -> str | None:
        """Write ``<root>/step-<step>`` atomically; its path (None on ranks other than the
        main one, which only take part in gathering the model)."""
        from turnscale.learner import checkpoint

        write = self.trainer.state_writer()
        if write is None:
            return None
        schedule = self.schedule.state_dict(step) if self.schedule is not None else None
        path = checkpoint.save(self.root, step=step, write_trainer=write, schedule=schedule, extra=extra, keep=self.keep)
        log.info("checkpoint %s", path)
        return path

    def load_latest(self) -> dict[str, Any] | None:
        """Restore the trainer from the newest complete checkpoint and check the schedule;
        returns the run's state (``extra``), or None when there is no checkpoint."""
        from turnscale.learner import checkpoint

        path = checkpoint.latest(self.root)
        if path is None:
            return None
        run = checkpoint.load_meta(path)
        trainer_step = self.trainer.load_state(path)
        if trainer_step != run.step:
            raise checkpoint.CheckpointError(f"{path}: the run's state is at step {run.step}, the trainer's at {trainer_step}")
        if run.schedule is not None and self.schedule is not None:
            self.schedule.check_resume(run.schedule, run.step)
        return dict(run.extra)


async def run(cfg: Config, play: EnvPlay | None = None) -> int:
    import trio

    from turnscale.learner.trainer import Trainer

    from turnscale import conf
    from turnscale.learner import ranks
    lc = cfg.learner
    channel = await trio.to_thread.run_sync(ranks.connect, cfg)  # None: one rank
    if channel is not None and channel.rank > 0:
        # SIGTERM (scancel, torchrun passing it on) is rank 0's to handle: it checkpoints, then
        # sends RankStop; a follower killed at once would fail rank 0's step instead.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return await trio.to_thread.run_sync(ranks.follow, cfg, channel)
    if channel is not None and cfg.algo.name == "sft" and lc.sft_data:
        raise conf.ConfigError("learner.sft_data (offline SFT) runs on one rank; start it without torchrun")
    os.makedirs(lc.dir, exist_ok=True)
    conf.save(cfg, os.path.join(lc.dir, "config.yaml"))  # the resolved config, next to checkpoints/
    model_path = await trio.to_thread.run_sync(resolve_model_path, cfg, play)
    if channel is None:
        if lc.strategy == "fsdp":
            log.info("learner.strategy=fsdp on one rank: nothing to shard (start several ranks with torchrun)")
        trainer = await trio.to_thread.run_sync(Trainer, cfg, model_path)
        return await _serve(cfg, trainer, model_path)
    from turnscale.protocol.messages import RankStart

    ranked = None
    try:
        await trio.to_thread.run_sync(channel.broadcast, RankStart(model_path=model_path, world_size=channel.world))
        trainer = await trio.to_thread.run_sync(Trainer, cfg, model_path)
        ranked = ranks.RankedTrainer(trainer, channel, lc.rank_timeout_s)
        log.info("learner rank 0 of %d: rank 0 serves, every rank trains its share of each step (learner.strategy=%s)",
                 channel.world, lc.strategy)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ranked.watch, name="ranks")  # a follower lost while idle ends the run
            code = await _serve(cfg, ranked, model_path)
            nursery.cancel_scope.cancel()
    except BaseException as exc:
        if ranked is not None and not isinstance(exc, ranks.RankError):  # a lost rank: torchrun ends the others
            ranked.stop("error")
        raise
    await trio.to_thread.run_sync(ranked.stop, "done")
    return code


async def _serve(cfg: Config, trainer: Any, model_path: str) -> int:
    """Rank 0 (or the only rank): the service around ``trainer`` until the run ends."""
    import trio

    from turnscale.learner.metrics import make_logger
    from turnscale.learner.schedule import TurnSchedule
    from turnscale.learner.service import LearnerService, ServiceParts
    from turnscale.learner.trajlog import NullTrajectoryLog, TrajectoryLog
    from turnscale.learner.weights import WeightPublisher
    from turnscale.protocol.transport import tcp_endpoint

    lc = cfg.learner
    if cfg.algo.name == "sft" and lc.sft_data:
        from turnscale.learner.sft import run_sft

        logger = make_logger(cfg.logger, lc.dir)
        try:
            await trio.to_thread.run_sync(run_sft, cfg, trainer, logger)
        finally:
            logger.close()
        return 0
    schedule = TurnSchedule.from_config(cfg.schedule)
    ctx, auth, curve = _curve_context(cfg)
    try:
        publisher = WeightPublisher(tcp_endpoint(lc.host, lc.weights_port), chunk_mb=lc.chunk_mb, dtype=lc.transfer_dtype,
                                    context=ctx, curve=curve, shm=lc.weights_shm)
    except BaseException:
        _close_context(ctx, auth)
        raise
    logger = make_logger(cfg.logger, lc.dir)
    trajlog = TrajectoryLog(lc.dir, decode=trainer.tokenizer.decode) if lc.save_trajectories else NullTrajectoryLog()
    parts = ServiceParts(
        trainer=trainer, publisher=publisher, weights=lambda: trainer.state_dict_for_publish(lc.transfer_dtype),
        schedule=schedule, checkpointer=TrainerCheckpointer(trainer, os.path.join(lc.dir, "checkpoints"), schedule, lc.keep_checkpoints),
        logger=logger, trajlog=trajlog, model_path=model_path,
        vocab_size=int(trainer.hf_model.get_input_embeddings().num_embeddings), curve=curve, context=ctx,
    )
    service = LearnerService(cfg, parts)
    try:
        if lc.resume and not await trio.to_thread.run_sync(service.restore):
            log.info("resume=true but no checkpoint under %s; starting fresh", lc.dir)
        async with trio.open_nursery() as n:
            n.start_soon(_stop_on_signal, n.cancel_scope, service)
            await service.serve()
            n.cancel_scope.cancel()
    finally:
        publisher.close()
        logger.close()
        trajlog.close()
        _close_context(ctx, auth)
    return 0


def _curve_context(cfg: Config) -> tuple[Any, Any, Any]:
    """``(zmq context, ZAP authenticator or None, CURVE server keys or None)`` for the
    learner's sockets: with CURVE on, every socket serves CURVE and the authenticator
    (its own thread, on this one context) admits only the keys in ``learner.curve.authorized``."""
    import zmq

    from turnscale.common.curve import learner_curve
    from turnscale.protocol.curve import ZapAuthenticator

    setup = learner_curve(cfg.learner)  # CurveConfigError (exit 2) before anything binds
    ctx = zmq.Context()
    if setup is None:
        return ctx, None, None
    auth = ZapAuthenticator(ctx, setup.authorized, log, what="learner's sockets")
    log.info("CURVE on: learner key %s, %d authorized actor key(s) in %s", setup.public.decode(),
             len(auth.provider.keys), setup.authorized)
    return ctx, auth, setup.server()


def _close_context(ctx: Any, auth: Any) -> None:
    if auth is not None:
        auth.stop()
    ctx.destroy(linger=0)


async def _stop_on_signal(scope: Any, service: Any) -> None:
    """SIGTERM/SIGINT: checkpoint (when a checkpointer is configured) and stop; actors keep
    running and reconnect when a learner with ``resume=true`` comes back."""
    import trio

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
        async for sig in sigs:
            log.info("learner got %s; checkpointing and stopping", signal.Signals(sig).name)
            await checkpoint_and_stop(scope, service)
            return


async def checkpoint_and_stop(scope: Any, service: Any) -> None:
    """Wait for the step in progress (``service.train_lock``), checkpoint, and cancel ``scope``
    *before* releasing the lock, so no step starts after the checkpoint.  Every group acked
    by then is trained or in the checkpoint (``LearnerService.checkpoint_extra``: buffered,
    in hand or leased: re-issued on resume); a group acked while the checkpoint is written
    answers a lease that is live in it, or one drawn after its task cursor: re-issued too.
    At step 0 nothing is written: a resume starts afresh and replays the same task stream."""
    import trio

    with trio.CancelScope(shield=True):
        async with service.train_lock:
            if service.step > 0:
                await service.save_checkpoint()
            scope.cancel()


def main(argv: Iterable[str] | None = None, play: EnvPlay | None = None) -> int:
    import trio

    from turnscale import conf
    try:
        cfg = conf.load(list(sys.argv[1:] if argv is None else argv))
    except conf.ConfigError as exc:
        print(f"turnscale learner: {exc}", file=sys.stderr)
        return 2
    from turnscale.common.curve import learner_curve

    try:
        learner_curve(cfg.learner, warn=False)  # key files checked before the model is built; run() warns
    except conf.ConfigError as exc:
        print(f"turnscale learner: {exc}", file=sys.stderr)
        return 2
    from turnscale.common.procs import setup_process

    setup_process()
    try:
        return trio.run(run, cfg, play)
    except BaseException as exc:
        lost = _rank_error(exc)
        if lost is None:
            raise
        print(f"turnscale learner: {lost}", file=sys.stderr)
        return 1


def _rank_error(exc: BaseException) -> Any:
    """The ``RankError`` in ``exc`` (also inside trio's exception groups), or None."""
    from turnscale.learner.ranks import RankError

    if isinstance(exc, RankError):
        return exc
    for inner in getattr(exc, "exceptions", ()):
        found = _rank_error(inner)
        if found is not None:
            return found
    return None
