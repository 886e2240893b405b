"""The running part of ``turnscale eval``: models x turn limits x tasks x samples -> episode records.

Not wired yet: it needs the actor code (``actors/episode.py``) and the envhub client
(``envhub/client.py``), which live on other branches until they are merged.
"""

from __future__ import annotations

from pathlib import Path


class EvalNotBuilt(RuntimeError):
    """The running part of ``turnscale eval`` is not available in this build."""


def run_eval(cfg, models: list[tuple[str, str]], task_ids: list[int], *, samples: int, turn_limits: list[int],
             split: str, concurrency: int, out_jsonl: Path, progress: bool = True) -> list[dict]:
    raise EvalNotBuilt("turnscale eval: running models is not built yet (needs actors/episode.py and envhub/client.py); "
                       "report on recorded episodes with --from-jsonl FILE")
