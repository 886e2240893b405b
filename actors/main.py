"""``turnscale actor [hydra overrides]`` / ``python -m turnscale.actors``: one actor process.

``build_actor(cfg)`` wires the real parts into ``actors.actor.Actor`` (the loop takes them
as ``ActorDeps``), phase by phase:

1. config: the actor's id (``actor.actor_id`` or a fresh one), engine name and device;
2. engine factory: ``RuntimeBuilder``, run by the actor after the first Welcome (and again
   when the engine breaks), builds the engine (``make_engine``) from the learner's model
   folder, the renderer from its tokenizer, and a ``GroupPlayer`` on both, which plays a
   lease's group (``actors.episode.run_group``) with the env's action parser and
   instruction prompt and the sampling of the learner's latest Welcome;
3. env client factory: ``env_client`` speaks the flavor the learner announces
   (``EnvEndpoint.flavor`` from its ``env.options.flavor``), so actors can play on
   AgentGym's own servers;
4. weight pull: ``pull_into`` / ``new_receive_buffer`` (``actors.weight_sync``) and the
   relay serving this actor's chunks to others (``start_relay``, ``actors.relay``);
5. the actor loop itself (``Actor``).

Heavy modules (transformers, torch, the engines) are imported only when the part that
needs them runs.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

from turnscale.conf.schema import ActorConfig, Config, EngineConfig

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from turnscale.actors.actor import Actor, Runtime
    from turnscale.actors.engine import Engine
    from turnscale.actors.envpool import EnvClientLike, PooledSession
    from turnscale.actors.weight_sync import ReceiveBuffer
    from turnscale.common.curve import CurveSetup
    from turnscale.common.renderer import Renderer
    from turnscale.protocol.messages import Lease, SamplingParams, TrajectoryGroup, WeightManifest, Welcome
    from turnscale.protocol.transport import AsyncSocket

log = logging.getLogger("turnscale.actor")


@dataclass
class GroupPlayer:
    """Plays one lease's group on the engine: ``lease.group_size`` episodes, one env session each."""

    engine: Engine
    renderer: Renderer
    actor_id: str
    """Stamped on every group (``TrajectoryGroup.actor_id``)."""
    sampling: Callable[[], SamplingParams]
    """The sampling of the learner's latest Welcome; read per group (a reconnect may bring
    a restarted learner's Welcome, while the engine and this player stay)."""

    async def play(self, lease: Lease, sessions: list[PooledSession]) -> TrajectoryGroup:
        """The actor's ``Runtime.play_group``: the parser and prompt are the lease's env's."""
        from turnscale.actors.episode import run_group
        from turnscale.common.parsing import parser_for
        from turnscale.common.prompts import instruction

        return await run_group(
            engine=self.engine, renderer=self.renderer, sessions=sessions.__getitem__, lease=lease, actor_id=self.actor_id,
            sampling=self.sampling(), parser=parser_for(lease.task.env), prompt=instruction(lease.task.env),
        )


@dataclass
class RuntimeBuilder:
    """The actor's ``make_runtime``: a Welcome -> the engine and a ``GroupPlayer`` on it."""

    engine_cfg: EngineConfig
    actor_id: str
    sampling: Callable[[], SamplingParams]
    """Handed to every ``GroupPlayer`` it builds."""

    async def __call__(self, welcome: Welcome) -> Runtime:
        import trio

        from turnscale.actors.actor import Runtime
        from turnscale.common.renderer import Renderer

        engine, tokenizer = await trio.to_thread.run_sync(self._load, welcome.model_path)
        renderer = Renderer.for_tokenizer(tokenizer, welcome.renderer)
        player = GroupPlayer(engine=engine, renderer=renderer, actor_id=self.actor_id, sampling=self.sampling)
        return Runtime(engine=engine, play_group=player.play)

    def _load(self, model_path: str) -> tuple[Engine, PreTrainedTokenizerBase]:
        """The engine and the tokenizer of ``model_path`` (in a worker thread: this loads weights)."""
        from transformers import AutoTokenizer

        from turnscale.actors.engines import make_engine

        tok = AutoTokenizer.from_pretrained(model_path)
        return make_engine(self.engine_cfg, model_path, tok), tok


def env_client(url: str, flavor: str) -> EnvClientLike:
    """``ActorDeps.make_env_client``: an envhub client speaking ``flavor``."""
    from turnscale.common.envclient import EnvClient

    return EnvClient(url, flavor=flavor)


def batching_env_client(url: str, flavor: str) -> EnvClientLike:
    """``env_client`` that coalesces concurrent steps into ``/v1/step_batch`` on envhub servers
    (``actor.env_batch_steps``); other flavors have no such route and step one at a time."""
    from turnscale.common.envclient import EnvClient

    return EnvClient(url, flavor=flavor, batch_steps=flavor == "turnscale")


async def pull_into(sock: AsyncSocket, manifest: WeightManifest, timeout_s: float,
                    buffer: ReceiveBuffer | None, **relay: Any) -> dict[str, torch.Tensor]:
    """``ActorDeps.pull``: every chunk of ``manifest`` over ``sock`` into ``buffer``
    (``relay``: ``relays``, ``on_chunk``, ``report`` of ``pull_weights``)."""
    from turnscale.actors.weight_sync import pull_weights

    return await pull_weights(sock, manifest, timeout_s=timeout_s, buffer=buffer, **relay)


def relay_address(cfg: ActorConfig) -> str:
    """The address other actors reach this actor's relay at (``actor.relay_host``), or ""
    for none: relays off, or the learner is on this host (``learner_host`` is a loopback
    address), where the direct local pull is the fastest path."""
    import ipaddress
    import socket

    if not cfg.relay:
        return ""
    if cfg.relay_host:
        return cfg.relay_host
    try:
        learner = socket.gethostbyname(cfg.learner_host)
        if ipaddress.ip_address(learner).is_loopback:
            return ""
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # no packet is sent: only the route is looked up
            s.connect((learner, cfg.learner_port))
            return s.getsockname()[0]
    except OSError as exc:
        log.warning("no relay: cannot find this host's address towards the learner (%s)", exc)
        return ""


def start_relay(cfg: ActorConfig, curve: CurveSetup | None = None) -> Any:
    """This actor's ``RelayServer`` (``actors/relay.py``), or None (``relay_address``).
    With CURVE towards the learner (``curve``), the relay serves CURVE with the actor's own
    key pair (its public key goes out in ``Hello.relay_public_key``).
    ``TURNSCALE_TEST_RELAY_CORRUPT=1`` makes it serve corrupted bytes (tests only)."""
    host = relay_address(cfg)
    if not host:
        return None
    from turnscale.actors.relay import RelayServer
    from turnscale.protocol.transport import tcp_endpoint

    return RelayServer(tcp_endpoint(host, cfg.relay_port), curve=curve.server() if curve is not None else None,
                       corrupt=os.environ.get("TURNSCALE_TEST_RELAY_CORRUPT") == "1")


def new_receive_buffer() -> ReceiveBuffer:
    """``ActorDeps.new_buffer``: one reusable receive buffer for ``pull_into``."""
    from turnscale.actors.weight_sync import ReceiveBuffer

    return ReceiveBuffer()


def build_actor(cfg: Config) -> Actor:
    """The actor process's ``Actor`` with the real parts (see the module docstring).
    Raises ``common.curve.CurveConfigError`` when CURVE is on and a key file is wrong."""
    from turnscale.actors.actor import Actor, ActorDeps, default_actor_id
    from turnscale.common.curve import actor_curve

    curve = actor_curve(cfg.actor)

    # 1. config: the id is fixed here because the group player stamps it on every group
    actor_id = cfg.actor.actor_id or default_actor_id()

    def latest_sampling() -> SamplingParams:
        """The sampling of the Welcome the actor adopted last (groups are played only after one)."""
        assert actor.welcome is not None, "a group was played before the first Welcome"
        return actor.welcome.sampling

    # 2. engine factory: engine, renderer and group player, built after the first Welcome
    make_runtime = RuntimeBuilder(engine_cfg=cfg.engine, actor_id=actor_id, sampling=latest_sampling)
    # 3. env client factory, 4. weight pull
    deps = ActorDeps(make_runtime=make_runtime, make_env_client=batching_env_client if cfg.actor.env_batch_steps else env_client, pull=pull_into, new_buffer=new_receive_buffer,
                     relay=start_relay(cfg.actor, curve))
    # 5. runtime: the actor loop (``Actor.run``) drives all of it
    actor = Actor(cfg=cfg.actor, deps=deps, engine_name=cfg.engine.name, device=cfg.engine.device, actor_id=actor_id,
                  curve=curve)
    return actor


def main(argv: Iterable[str] | None = None) -> int:
    import trio

    from turnscale import conf
    try:
        cfg = conf.load(list(sys.argv[1:] if argv is None else argv))
    except conf.ConfigError as exc:
        print(f"turnscale actor: {exc}", file=sys.stderr)
        return 2
    from turnscale.common.procs import setup_process

    setup_process()
    try:
        actor = build_actor(cfg)
    except conf.ConfigError as exc:  # CURVE key files
        print(f"turnscale actor: {exc}", file=sys.stderr)
        return 2
    code = trio.run(actor.run)
    exit_now(code)
    return code  # not reached


def exit_now(code: int) -> None:
    """End the process at once once ``Actor.run`` has returned: logs flushed, then ``os._exit``.
    Everything the actor owns is closed by then (sessions, env instances, engine, sockets);
    what remains is interpreter teardown of torch/transformers (seconds on a loaded host) and
    any engine thread a library left behind (vLLM's), which would push a stopped actor past
    Slurm's ``KillWait`` (docs/architecture.md, "Graceful stop")."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
