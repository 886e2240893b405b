"""``turnscale run``'s recipe fit on a real level mix: the oracle's survey, the turn limits and
the context budget measured with the model's own tokenizer (in process, no RL)."""

from __future__ import annotations

import json

import torch

from turnscale import conf
from turnscale.launch import Launcher

torch.set_num_threads(1)


def _prepared(tmp_path, levels: str, *extra: str) -> Launcher:
    cfg = conf.load(["experiment=run_babyai", f"run.dir={tmp_path / 'run'}", f"model.cache_dir={tmp_path / 'models'}",
                     f"env.options.levels={levels}", "run.warmup_seeds=0:12", "run.warm_start.episodes=24", *extra])
    launcher = Launcher(cfg)
    try:
        launcher.prepare()
    finally:
        launcher.procs.close()
    return launcher


def test_a_long_mix_gets_longer_turn_limits_and_the_context_to_hold_them(tmp_path):
    launcher = _prepared(tmp_path, "[20,25]")  # PickupAbove, KeyInBox: up to ~10-16 oracle turns
    cfg, recipe = launcher.cfg, launcher.recipe
    assert recipe["fit"]["changed"] and max(cfg.schedule.turns) == recipe["fit"]["horizon"] > 8
    assert cfg.run.eval_turns == max(cfg.schedule.turns) and cfg.run.warm_start.max_turns >= cfg.run.eval_turns
    assert cfg.algo.loss_agg == "seq_mean_token_mean"  # run.adapt_loss_agg for stretched turn limits
    c = recipe["context"]
    assert c["tokens"] == cfg.sampling.max_context_tokens >= 2048
    assert c["first_prompt"] + c["horizon"] * c["per_turn"] <= c["tokens"] or c["tokens"] == 4096
    assert [s["level"] for s in recipe["survey"]] == ["BabyAI-PickupAbove-v0", "BabyAI-KeyInBox-v0"]


def test_the_default_goto_mix_keeps_the_calibrated_turn_limits_and_context(tmp_path):
    launcher = _prepared(tmp_path, "[0,1,2,3,4]")
    assert launcher.cfg.schedule.turns == [3, 5, 8] and launcher.cfg.run.eval_turns == 3
    assert launcher.cfg.sampling.max_context_tokens == 2048 and launcher.recipe["context"] is None
    assert not launcher.recipe["fit"]["changed"] and launcher.cfg.algo.loss_agg == "token_mean"


def _assistant_turns(launcher: Launcher) -> list[int]:
    lines = (launcher.dir / "warmstart" / "conversations.jsonl").read_text().splitlines()
    return [sum(m["role"] == "assistant" for m in json.loads(line)["messages"]) for line in lines]


def test_a_fumbling_demonstrator_writes_longer_conversations_and_leaves_the_fit_to_the_oracle(tmp_path):
    """``run.warm_start.action_noise``: the demonstrations carry random actions (so they are
    longer), while the turn-limit fit still surveys the oracle's own play."""
    clean = _prepared(tmp_path / "clean", "[0,1,2,3,4]")
    noisy = _prepared(tmp_path / "noisy", "[0,1,2,3,4]", "run.warm_start.action_noise=0.5")
    assert noisy.cfg.schedule.turns == clean.cfg.schedule.turns == [3, 5, 8]
    assert noisy.recipe["survey"] == clean.recipe["survey"]
    c, n = _assistant_turns(clean), _assistant_turns(noisy)
    assert len(n) >= 0.8 * len(c) and sum(n) / len(n) > 1.2 * sum(c) / len(c), (c, n)
