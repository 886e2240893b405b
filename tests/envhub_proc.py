"""Test helper: ``envhub_server(env, **overrides) -> base_url`` (a real server process on a free
127.0.0.1 port, healthy on entry, ended by pid on exit), ``envhub_process`` when a test needs the
process too.  Lives in ``benchmarks.envhub_launch``."""

from turnscale.benchmarks.envhub_launch import envhub_process, envhub_server, free_port, stop, wait_healthy

__all__ = ["envhub_process", "envhub_server", "free_port", "stop", "wait_healthy"]
