"""``turnscale envhub env=<name> host=127.0.0.1 port=<port> [env.* overrides]``: serve one env family.

``host=`` and ``port=`` at top level are shorthands for ``env.host`` / ``env.port``.  The
process redirects its stdout to stderr (envs such as minigrid print during level
generation), raises its open-files limit to fit ``env.limits.max_connections``, serves with
uvicorn (``envhub.httpserver``: connection, header and keep-alive limits) until
SIGTERM/SIGINT, then closes every instance and the family, each step bounded
by ``env.limits.shutdown_timeout_s``, and exits 0.  With ``env.exit_after_idle_s`` set, it
also shuts down the same way by itself once no env request has arrived for that long
(``envhub.server.IdleExit``; it logs why) and exits ``EXIT_IDLE`` (4).  The exit does not
wait for worker threads: an env call that overran its deadline may never return, and the
interpreter's usual exit would join its thread forever.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

SHORTHANDS = {"host": "env.host", "port": "env.port"}
EXIT_IDLE = 4
"""Exit code after ``env.exit_after_idle_s`` without env requests: no learner's actors left
(the code of an actor that gave up on its learner, ``actors.actor.EXIT_LEARNER_GONE``)."""


def rewrite_overrides(argv: list[str]) -> list[str]:
    """``host=X`` -> ``++env.host=X``, ``port=N`` -> ``++env.port=N``, ``env.K=V`` ->
    ``++env.K=V``: ``++`` sets a key whether or not the env's yaml names it (Hydra refuses a
    plain override of a schema key the yaml lacks); a misspelled key is still refused by the
    typed schema, naming the key."""
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        bare = key.lstrip("+~")
        if sep and key == bare and bare in SHORTHANDS:
            arg = f"++{SHORTHANDS[bare]}={value}"
        elif sep and key == bare and bare.startswith("env."):
            arg = f"++{bare}={value}"
        out.append(arg)
    return out


def _quiet_stdout() -> None:
    sys.stdout.flush()
    os.dup2(2, 1)
    sys.stdout = sys.stderr


def main(argv: list[str] | None = None) -> int:
    from turnscale import conf
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = conf.load(rewrite_overrides(argv))
    if os.environ.get("OMP_NUM_THREADS"):
        try:  # only if some env pulled torch in; never import it ourselves
            if "torch" in sys.modules:
                sys.modules["torch"].set_num_threads(1)
        except Exception:
            pass
    logging.basicConfig(level=logging.INFO, format="%(asctime)s envhub[%(process)d] %(levelname)s %(message)s", stream=sys.stderr)
    _quiet_stdout()
    rc = serve(cfg.env)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(rc)  # not sys.exit: that joins every worker thread, including abandoned ones


FD_HEADROOM = 256
"""Open files beyond ``env.limits.max_connections`` (listening socket, logs, envs' own files)."""


def raise_open_files_limit(max_connections: int) -> None:
    """Raise this process's soft ``RLIMIT_NOFILE`` to ``max_connections + FD_HEADROOM`` (at most
    the hard limit): with the common soft limit of 1024, accepting would fail with EMFILE
    before ``max_connections`` (1024 by default) and its per-address share are reached."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + FD_HEADROOM
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    if want < max_connections + FD_HEADROOM:
        logging.getLogger("envhub").warning("open-files limit %d is below env.limits.max_connections (%d) + %d: raise `ulimit -n`",
                                            want, max_connections, FD_HEADROOM)


def serve(env_cfg) -> int:
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn re-raises a captured SIGTERM after its graceful shutdown (exit -15);
        an envhub stopped by SIGTERM has shut down cleanly and exits 0."""

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM:
                self._captured_signals.remove(sig)

    from turnscale.envhub.httpserver import uvicorn_config
    from turnscale.envhub.registry import make_family
    from turnscale.envhub.server import create_app

    # Env calls run in ``env.options.server_threads`` worker threads (default 8);
    # ``env.options.switch_interval_s`` sets the GIL switch interval (Python's default 5 ms).
    if "switch_interval_s" in env_cfg.options:
        sys.setswitchinterval(float(env_cfg.options["switch_interval_s"]))
    raise_open_files_limit(env_cfg.limits.max_connections)
    family = make_family(env_cfg)
    servers: list[_Server] = []

    def stop_serving() -> None:  # IdleExit: the graceful shutdown a SIGTERM starts
        servers[0].should_exit = True

    app = create_app(family, env_cfg, threads=int(env_cfg.options.get("server_threads", 8)), on_idle=stop_serving)
    config = uvicorn_config(app, env_cfg.host, env_cfg.port, env_cfg.limits)
    servers.append(server := _Server(config))
    logging.getLogger("envhub").info("serving %s on http://%s:%d", env_cfg.name, env_cfg.host, env_cfg.port)
    server.run()
    if not server.started:
        return 1
    return EXIT_IDLE if app.state.idle_exit is not None and app.state.idle_exit.fired else 0


if __name__ == "__main__":
    raise SystemExit(main())
