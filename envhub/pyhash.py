"""The iteration order of Python ``set``\\ s of strings in a CPython process started with a
given ``PYTHONHASHSEED`` — to reproduce servers whose output follows set order (AgentGym's
TextCraft builds its crafting-command list from sets).

``set_orders(lists, hashseed)`` runs one child process of this same interpreter with
``PYTHONHASHSEED=hashseed``, builds ``set(strings)`` for each list (inserting in list order,
as successive ``set.add`` calls do) and returns ``list(that set)`` for each.  A string's hash,
and so the order, depends on the seed *and* on the CPython version (3.11+ hash strings with
SipHash-1-3, earlier versions with SipHash-2-4): the result equals the other process's order
only when it runs the same CPython minor version.  Only strings and lists cross the pipe
(JSON); the child runs no code of ours (and not ``-I``/``-E``, which would ignore the seed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

_CHILD = "import json, sys\nprint(json.dumps([list(set(x)) for x in json.load(sys.stdin)]))\n"


class HashOrderError(RuntimeError):
    """The helper process failed or answered something unexpected."""


def set_orders(lists: list[list[str]], hashseed: int, timeout_s: float = 120.0) -> list[list[str]]:
    """``[list(set(x)) for x in lists]`` as a process with ``PYTHONHASHSEED=hashseed`` orders them."""
    if not 0 <= int(hashseed) <= 4294967295:
        raise ValueError(f"hashseed must be in [0, 4294967295] (PYTHONHASHSEED's range), got {hashseed}")
    env = {**os.environ, "PYTHONHASHSEED": str(int(hashseed))}
    proc = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(lists), capture_output=True,
                          text=True, timeout=timeout_s, env=env, check=False)
    if proc.returncode != 0:
        raise HashOrderError(f"hash-order helper exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    out = json.loads(proc.stdout)
    if len(out) != len(lists) or any(sorted(a) != sorted(set(b)) for a, b in zip(out, lists)):
        raise HashOrderError("hash-order helper answered lists that are not the sets it was given")
    return out
