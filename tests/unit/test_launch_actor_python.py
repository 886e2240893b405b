"""``run.actor_python``: the engine processes' interpreter is checked before a run starts.
(The run itself on ``.venv-vllm`` is ``tests/integration/test_run_vllm.py``.)"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from turnscale import conf
from turnscale.launch import Launcher
from turnscale.common.procs import ChildFailed


def _launcher(tmp_path, *overrides):
    return Launcher(conf.load(["experiment=run_babyai", f"run.dir={tmp_path}", *overrides]))


def test_a_missing_actor_python_stops_the_run_before_any_work(tmp_path):
    with pytest.raises(ChildFailed, match=r"run.actor_python='/nonexistent/python' is not an executable Python"):
        _launcher(tmp_path, "run.actor_python=/nonexistent/python").check_engine_python()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="this interpreter has vLLM")
def test_engine_vllm_with_an_actor_python_without_vllm_names_the_setup_script(tmp_path):
    with pytest.raises(ChildFailed, match=r"vLLM is not installed for .*bash scripts/setup_vllm.sh"):
        _launcher(tmp_path, "engine=vllm_cpu", f"run.actor_python={sys.executable}").check_engine_python()
    _launcher(tmp_path, f"run.actor_python={sys.executable}").check_engine_python()  # engine=hf: any Python


def test_a_relative_actor_python_is_made_absolute_without_resolving_the_venv_symlink(tmp_path):
    launcher = _launcher(tmp_path, "run.actor_python=.venv-vllm/bin/python")
    assert launcher.engine_python().endswith("/.venv-vllm/bin/python") and launcher.engine_python().startswith("/")
    assert _launcher(tmp_path).engine_python() == ""
