"""``turnscale actor [hydra overrides]`` / ``python -m actors``: one actor process.

``run(cfg)`` wires the real parts into ``actors.actor.Actor``: after the first Welcome the
engine (``make_engine``) is built from the learner's model folder, the renderer from its
tokenizer, and the group player from ``actors.episode.run_group`` with the env's action
parser and instruction prompt; weights come through ``actors.weight_sync.pull_weights``;
env sessions through ``common.envclient.EnvClient`` speaking the flavor the learner announces
(``EnvEndpoint.flavor`` from its ``env.options.flavor``), so actors can play on AgentGym's own
servers.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Iterable

from conf.schema import Config

log = logging.getLogger("turnscale.actor")


def build_actor(cfg: Config) -> Any:
    import trio

    from actors.actor import Actor, ActorDeps, Runtime

    holder: dict[str, Any] = {}

    async def make_runtime(welcome: Any) -> Runtime:
        from transformers import AutoTokenizer

        from actors.engines import make_engine
        from actors.episode import run_group
        from common.parsing import parser_for
        from common.prompts import instruction
        from common.renderer import Renderer

        def load() -> tuple[Any, Any]:
            tok = AutoTokenizer.from_pretrained(welcome.model_path)
            return make_engine(cfg.engine, welcome.model_path, tok), tok

        engine, tokenizer = await trio.to_thread.run_sync(load)
        renderer = Renderer.for_tokenizer(tokenizer, welcome.renderer)
        actor = holder["actor"]

        async def play_group(lease: Any, sessions: list[Any]) -> Any:
            return await run_group(
                engine=engine, renderer=renderer, sessions=lambda i: sessions[i], lease=lease, actor_id=actor.actor_id,
                sampling=actor.welcome.sampling, parser=parser_for(lease.task.env), prompt=instruction(lease.task.env),
            )

        return Runtime(engine=engine, play_group=play_group)

    async def pull(sock: Any, manifest: Any, timeout_s: float, buffer: Any) -> Any:
        from actors.weight_sync import pull_weights

        return await pull_weights(sock, manifest, timeout_s=timeout_s, buffer=buffer)

    def new_buffer() -> Any:
        from actors.weight_sync import ReceiveBuffer

        return ReceiveBuffer()

    def make_env_client(url: str, flavor: str) -> Any:
        from common.envclient import EnvClient

        return EnvClient(url, flavor=flavor)

    actor_kw = {"actor_id": cfg.actor.actor_id} if cfg.actor.actor_id else {}
    actor = Actor(cfg=cfg.actor, deps=ActorDeps(make_runtime=make_runtime, pull=pull, make_env_client=make_env_client,
                                                      new_buffer=new_buffer),
                  engine_name=cfg.engine.name, device=cfg.engine.device, **actor_kw)
    holder["actor"] = actor
    return actor


def main(argv: Iterable[str] | None = None) -> int:
    import trio

    import conf

    try:
        cfg = conf.load(list(sys.argv[1:] if argv is None else argv))
    except conf.ConfigError as exc:
        print(f"turnscale actor: {exc}", file=sys.stderr)
        return 2
    from common.procs import setup_process

    setup_process()
    actor = build_actor(cfg)
    return trio.run(actor.run)
