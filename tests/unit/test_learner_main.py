from turnscale import conf
from turnscale.learner.main import FALLBACK_CORPUS, resolve_model_path
from turnscale.learnerapp import env_corpus


def test_tiny_model_corpus_is_the_envs_own_text_and_deterministic():
    cfg = conf.load(["env=babyai"])
    a = env_corpus(cfg, episodes=3)
    assert a == env_corpus(cfg, episodes=3)  # same corpus -> same cached tiny model for every process
    assert sum("Your goal:" in t for t in a) >= 3
    assert any("Available actions" in t for t in a)
    assert a[: len(FALLBACK_CORPUS)] == FALLBACK_CORPUS


def test_init_from_wins_over_model_path(tmp_path):
    cfg = conf.load([f"learner.init_from={tmp_path}"])
    assert resolve_model_path(cfg) == str(tmp_path)
