"""Test helper: ``envhub_server(env, **overrides) -> base_url`` (a real server process on a free
127.0.0.1 port, healthy on entry, ended by pid on exit).  Lives in ``benchmarks.envhub_launch``."""

from turnscale.benchmarks.envhub_launch import envhub_server, free_port, stop, wait_healthy

__all__ = ["envhub_server", "free_port", "stop", "wait_healthy"]
