"""``turnscale keys DIR [--actors N] [--force]``: CURVE key files for a learner and its actors.

Writes (``protocol.curve.create_keys``; pyzmq certificate format, secrets mode 0600)::

    DIR/learner.key_secret      learner.curve.secret_key     (stays on the learner's host)
    DIR/authorized/             learner.curve.authorized     (public keys of the actors let in)
    DIR/learner.key             actor.curve.server_key       (copy to every actor host)
    DIR/actor-N.key_secret      actor.curve.secret_key       (one per actor host or process)
    DIR/actor-N.key             actor N's public key

Prints the overrides each role needs.  Refuses to replace an existing learner key pair
without ``--force``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Iterable


def main(argv: Iterable[str] | None = None) -> int:
    from turnscale.protocol.curve import create_keys

    ap = argparse.ArgumentParser(prog="turnscale keys", description="Make CURVE key files for a learner and its actors.")
    ap.add_argument("dir", help="folder to write the keys into (created, mode 0700)")
    ap.add_argument("--actors", type=int, default=1, help="actor key pairs to make (default 1)")
    ap.add_argument("--force", action="store_true", help="replace an existing learner key pair")
    args = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.actors < 0:
        ap.error("--actors must be >= 0")
    try:
        ks = create_keys(args.dir, args.actors, force=args.force)
    except (OSError, ValueError) as exc:
        print(f"turnscale keys: {exc}", file=sys.stderr)
        return 2
    d = os.path.abspath(args.dir)
    print(f"wrote a learner key pair and {args.actors} actor key pair(s) to {d}")
    print(f"learner: learner.curve.secret_key={os.path.abspath(ks.learner_secret)} "
          f"learner.curve.authorized={os.path.abspath(ks.authorized)}")
    for sec in ks.actor_secrets:
        print(f"actor:   actor.curve.server_key={os.path.abspath(ks.learner_public)} actor.curve.secret_key={os.path.abspath(sec)}")
    print("CURVE is on by default when learner.host / actor.learner_host is not a loopback address "
          "(learner.curve.enabled / actor.curve.enabled=true forces it on loopback).")
    return 0
