"""Environment servers over HTTP, wire-compatible with AgentGym's, with its defects fixed.

- ``base``: the ``Env`` / ``EnvFamily`` interface every env implements.
- ``server`` (+ ``instances``): ``create_app(family, cfg)``, the HTTP server of one family.
- ``workers``: env calls in worker threads under a deadline; ``bodies``: request bodies and
  JSON responses within the limits; ``httpserver``: uvicorn with connection, header and
  keep-alive limits (docs/security.md).
- ``main``: ``turnscale envhub env=<name> host=... port=...`` / ``python -m turnscale.envhub``.
- The async client of this HTTP API is ``common.envclient`` (the shared layer: actors use it).
- ``registry``: env name -> family factory; one module per family (``babyai``, ...).
- ``simwork``: the simulated long-tail workload a server applies when ``env.options.sim_latency``
  is set (benchmarks); ``corpus``: an env's text played in-process (the tiny tokenizer).
- ``babyai_oracle``: the BabyAI expert (high-level actions) for tests and warm starts; the env
  imports it (``BabyAIEnv.expert_action``, ``babyai.play_oracle``), it imports ``babyai_prims``.
"""
