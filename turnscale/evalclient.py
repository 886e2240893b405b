"""Env sessions for ``turnscale eval`` over ``common.envclient.EnvClient`` (one client, many instances).

``ClientPool.open()`` creates one env instance on the server and returns a session with the
``actors.episode.EnvSession`` shape (``reset(data_idx) -> (obs, info)``,
``step(action) -> (obs, reward, done, info)``).  ``aclose()`` closes every instance it created
(best effort: an instance the server already expired is not an error) and then the client.
The server's flavor comes from ``env.options.flavor`` (default ``turnscale``; ``agentgym`` for
AgentGym's own servers).
"""

from __future__ import annotations

from typing import Any

from turnscale.common.envclient import EnvClient, EnvClientError


class ClientSession:
    def __init__(self, client: EnvClient, env_id: int) -> None:
        self.client = client
        self.env_id = env_id

    async def reset(self, data_idx: int) -> tuple[str, dict]:
        reply = await self.client.reset(self.env_id, data_idx)
        return reply.observation, reply.info

    async def step(self, action: str) -> tuple[str, float, bool, dict]:
        reply = await self.client.step(self.env_id, action)
        info = dict(reply.info)
        info.setdefault("truncated", reply.truncated)
        return reply.observation, reply.reward, reply.done or reply.truncated, info


class ClientPool:
    def __init__(self, env_name: str, url: str, cfg: Any) -> None:
        self.client = EnvClient(url, flavor=cfg.env.client_flavor)
        self.ids: list[int] = []

    async def open(self) -> ClientSession:
        env_id = await self.client.create()
        self.ids.append(env_id)
        return ClientSession(self.client, env_id)

    async def aclose(self) -> None:
        import trio

        with trio.CancelScope(shield=True):
            for env_id in self.ids:
                try:
                    await self.client.close(env_id)
                except EnvClientError:
                    pass
            await self.client.aclose()
