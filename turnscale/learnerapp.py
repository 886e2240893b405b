"""``turnscale learner``: the learner role (``learner.main``) as the application runs it.

The learner builds the tiny model (``model.path=tiny``) on a corpus that includes the env's
own text, played in-process by envhub (``envhub.corpus.play_texts``).  Roles never import
each other, so the application hands that player to the learner here.
"""

from __future__ import annotations

from typing import Iterable

from turnscale.conf.schema import Config
from turnscale.envhub.corpus import play_texts
from turnscale.learner import main as learner_main


def env_corpus(cfg: Config, episodes: int = 24) -> list[str]:
    """The tiny model's corpus as ``turnscale learner`` builds it (``learner.main.env_corpus``
    with the env played in-process)."""
    return learner_main.env_corpus(cfg, episodes, play=play_texts)


def resolve_model_path(cfg: Config) -> str:
    """``learner.main.resolve_model_path`` with the env played in-process."""
    return learner_main.resolve_model_path(cfg, play=play_texts)


def main(argv: Iterable[str] | None = None) -> int:
    return learner_main.main(argv, play=play_texts)
