"""The shared layer: what several roles (``envhub``, ``actors``, ``learner``) and the
application need.  It imports only ``protocol``, ``conf`` and third-party libraries.

- ``logprobs``: the one log-prob convention (actors' engines and the learner).
- ``renderer``: chat rendering to token ids (actors, the learner's SFT, evaluation).
- ``prompts``, ``parsing``: per-env instruction prompts and action parsers.
- ``envclient`` (+ ``http11``): ``EnvClient``, the async (trio) client of envhub's HTTP
  API (AgentGym's wire protocol); actors and evaluation use it.
- ``procs``: process setup and child processes started and ended by pid.
- ``tinymodel``: the tiny local HF model + tokenizer (the learner, runs, tests, benchmarks).
"""
