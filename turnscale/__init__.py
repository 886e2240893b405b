"""turnscale: asynchronous actor-learner multi-turn RL for LLM agents.

The roles live in top-level packages (``envhub``, ``actors``, ``learner``, ``protocol``);
this package holds only the command-line launcher.
"""

__version__ = "0.1.0"
