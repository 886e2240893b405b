"""Per-env instruction prompts (kept in ``conf.envs``, the env table) and the first messages
of an episode.

AgentGym sends each env's fixed instruction as the first user turn and answers it with a
canned assistant "OK".  We put the instruction in a **system message** instead and the
env's first observation in the first user message: the same information, two fewer
template turns, and no fake assistant tokens in the stream (they would be masked anyway).
"""

from __future__ import annotations

from turnscale.conf.envs import env_spec


def instruction(env: str) -> str:
    """The instruction prompt of ``env`` (``conf.envs.EnvSpec.prompt``)."""
    return env_spec(env, what="instruction prompt").prompt


def initial_messages(prompt: str, observation: str) -> list[dict]:
    """``[system: prompt, user: observation]`` (no system message when ``prompt`` is empty)."""
    msgs = [{"role": "system", "content": prompt}] if prompt else []
    return msgs + [{"role": "user", "content": observation}]
