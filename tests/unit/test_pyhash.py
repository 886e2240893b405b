"""``envhub.pyhash``: set order as a process with a given PYTHONHASHSEED builds it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from turnscale.envhub.pyhash import set_orders

WORDS = [f"craft {i} stick using {i % 3} planks" for i in range(40)]


def _own_order(seed: int) -> list[str]:
    code = f"import json\ns = set()\nfor w in {WORDS!r}:\n    s.add(w)\nprint(json.dumps(list(s)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
                         env={**os.environ, "PYTHONHASHSEED": str(seed)})
    return json.loads(out.stdout)


def test_orders_equal_a_process_started_with_that_seed():
    got = set_orders([WORDS, WORDS[:5]], 11)
    assert got[0] == _own_order(11) and sorted(got[1]) == sorted(WORDS[:5])
    assert set_orders([WORDS], 12)[0] != got[0]


def test_out_of_range_seed_is_refused():
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        set_orders([WORDS], -1)
