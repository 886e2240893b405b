import pytest

from turnscale import conf
from turnscale.conf.schema import Config

GROUPS = {
    "env": ["babyai", "textcraft", "sciworld", "searchqa", "webarena", "web"],
    "algo": ["grpo", "dr_grpo", "rloo", "reinforce_pp", "ppo", "sft"],
    "engine": ["hf", "vllm", "vllm_cpu", "sim"],
    "schedule": ["fixed", "scaling"],
    "model": ["tiny", "qwen2_5_7b"],
    "logger": ["default"],
    "experiment": ["agentgym_babyai", "run_babyai", "run_web"],
}


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_group_option_composes_to_typed_config(group, option):
    cfg = conf.load([f"{group}={option}"])
    assert isinstance(cfg, Config)
    if group in ("env", "algo", "engine"):
        assert getattr(cfg, group).name == {"vllm_cpu": "vllm"}.get(option, option)  # vllm_cpu: a preset of vllm


def test_every_group_file_is_listed_here():
    from importlib import resources

    root = resources.files("conf")
    for group, opts in GROUPS.items():
        found = sorted(p.name[:-5] for p in (root / group).iterdir() if p.name.endswith(".yaml"))
        assert found == sorted(opts), group


def test_turnscale_run_picks_the_envs_own_experiment():
    from turnscale.launch import default_experiment

    assert default_experiment(["env=web", "learner.steps=2"]) == "run_web"
    assert default_experiment([]) == default_experiment(["env=textcraft"]) == "run_babyai"
    cfg = conf.load(["experiment=run_web"])
    assert cfg.env.name == "web" and cfg.env.options["obs_max_tokens"] == 1280


def test_misspelled_key_names_the_key():
    with pytest.raises(conf.ConfigError, match="algo.lrr"):
        conf.load(["algo.lrr=1"])
    with pytest.raises(conf.ConfigError, match="algo.lrr"):
        conf.load(["+algo.lrr=1"])


def test_bad_value_names_the_key():
    with pytest.raises(conf.ConfigError, match="algo.name"):
        conf.load(["algo.name=foo"])
    with pytest.raises(conf.ConfigError, match="env.port"):
        conf.load(["env.port=abc"])
    with pytest.raises(conf.ConfigError, match="schedule.turns"):
        conf.load(["schedule.turns=[]"])
    with pytest.raises(conf.ConfigError, match="run.warm_start.action_noise"):
        conf.load(["run.warm_start.action_noise=1.0"])


def test_experiment_overrides_groups():
    cfg = conf.load(["experiment=agentgym_babyai"])
    assert cfg.schedule.turns == [6, 13, 20]
    assert cfg.engine.name == "vllm"


def test_keys_no_yaml_sets_can_be_overridden_without_plus():
    cfg = conf.load(["learner.port=6001", "actor.max_groups=3", "run.actors=4"])
    assert (cfg.learner.port, cfg.actor.max_groups, cfg.run.actors) == (6001, 3, 4)
    with pytest.raises(conf.ConfigError, match="learner.portt"):
        conf.load(["learner.portt=1"])


def test_babyai_level_mix_is_an_env_option_and_the_old_key_names_the_new_one():
    from turnscale.envhub.babyai import RUN_LEVELS, run_levels

    assert run_levels(conf.load([]).env.options) == RUN_LEVELS
    assert run_levels(conf.load(["experiment=run_babyai"]).env.options) == [0, 1, 2, 3, 4]
    assert run_levels(conf.load(["++env.options.levels=[7,8]"]).env.options) == [7, 8]
    with pytest.raises(ValueError, match=r"env.options.levels"):
        run_levels({"levels": [40]})
    with pytest.raises(conf.ConfigError, match=r"run.levels' moved to 'env.options.levels'"):
        conf.load(["run.levels=[1,2]"])


def test_a_saved_resolved_config_loads_back_equal(tmp_path):
    cfg = conf.load(["experiment=run_babyai", "learner.steps=7", "++env.options.levels=[2,3]"])
    path = str(tmp_path / "config.yaml")
    conf.save(cfg, path)
    assert conf.load_file(path) == cfg
    assert "steps: 7" in open(path).read()


def test_actor_weights_shm_from_the_command_line_is_checked_and_lowercased():
    """``actor.weights_shm=false`` arrives from Hydra as a bool (``False``); it must mean
    ``false`` (an earlier second ``__post_init__`` skipped this, so ``false`` kept shared memory on)."""
    assert conf.load(["actor.weights_shm=false"]).actor.weights_shm == "false"
    assert conf.load(["actor.weights_shm=true"]).actor.weights_shm == "true"
    with pytest.raises(conf.ConfigError, match="actor.weights_shm"):
        conf.load(["actor.weights_shm=sometimes"])
    with pytest.raises(conf.ConfigError, match="actor.pool"):
        conf.load(["actor.pool="])
