"""turnscale: asynchronous actor-learner multi-turn RL for LLM agents.

The roles live in top-level packages (``envhub``, ``actors``, ``learner``) over the shared
layers (``protocol``, ``conf``, ``common``); this package is the application on top of them
(CLI, launcher, eval, viewer), and nothing below imports it (docs/ARCHITECTURE.md, Layers).
"""

__version__ = "0.1.0"
