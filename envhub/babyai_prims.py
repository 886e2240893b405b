"""BabyAI's primitive actions (minigrid's action ids) and the stdout guard: what the env
(``envhub.babyai``) and its oracle (``envhub.babyai_oracle``) share.  The env imports the
oracle (``BabyAIEnv.expert_action``, ``play_oracle``); the oracle imports only this module.
"""

from __future__ import annotations

import contextlib
import io
import threading

LEFT, RIGHT, FORWARD, PICKUP, DROP, TOGGLE, DONE = 0, 1, 2, 3, 4, 5, 6


_STDOUT_LOCK = threading.Lock()


@contextlib.contextmanager
def quiet_stdout():
    """Swallow what minigrid prints (level generation retries).  ``sys.stdout`` is process
    global, so swaps are serialised: unlocked, two threads' nested swaps can leave stdout
    pointing at a dead buffer.  (The envhub server also sends fd 1 to stderr.)"""
    with _STDOUT_LOCK, contextlib.redirect_stdout(io.StringIO()):
        yield
