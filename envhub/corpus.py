"""Text of an env family played in-process: the env's own observations for the tiny
model's tokenizer corpus (``learner.main.env_corpus``).

The learner may not import envhub (roles never import each other), so the application
(``turnscale learner``) and the benchmarks hand ``play_texts`` to the learner.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("turnscale.learner")  # runs in the learner's process, under its name


def play_texts(env_cfg: Any, episodes: int = 24) -> list[str]:
    """The observations of ``episodes`` episodes of ``env_cfg``'s family (a few fixed actions
    each), played in-process; ``[]`` when the env is unavailable (deps missing), what was
    collected when playing fails."""
    texts: list[str] = []
    try:
        from turnscale.envhub.registry import make_family

        family = make_family(env_cfg)
    except Exception as exc:  # env deps missing: the fixed lines still make a usable tokenizer
        log.warning("tiny-model corpus: env %s unavailable (%s); using built-in text only", env_cfg.name, exc)
        return texts
    try:
        env = family.create()
        for i in range(episodes):
            r = env.reset(i)
            texts.append(r.observation)
            for action in ("move forward", "turn left", "check available actions"):
                texts.append(env.step(action).observation)
        env.close()
    except Exception as exc:
        log.warning("tiny-model corpus: playing %s failed (%s); using what was collected", env_cfg.name, exc)
    finally:
        family.close()
    return texts
