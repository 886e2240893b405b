"""benchmarks/levers.py: the lever study's commands and its mean ± sd table (no runs)."""

import json

import pytest

from benchmarks import levers


def _summary(path, warm, final, wall=100.0):
    path.mkdir(parents=True)
    by = {"BabyAI-GoToRedBall-v0": final}
    (path / "summary.json").write_text(json.dumps({"warm_start": {"success": warm}, "final": {"success": final, "by_category": by},
                                                   "wall_s": wall}))


def test_each_run_is_turnscale_run_with_its_seed_steps_and_the_levers_overrides(tmp_path):
    cmd = levers._cmd(tmp_path, "layers4", 3, 40)
    assert cmd[1:4] == ["-m", "turnscale", "run"]
    assert f"run.dir={tmp_path / 'layers4-s3'}" in cmd and "learner.seed=3" in cmd and "learner.steps=40" in cmd
    assert cmd[-1] == "model.tiny.num_layers=4"
    own = levers._cmd(tmp_path, "sft100_rl120", 0, 40)  # its own learner.steps replaces the study's
    assert [c for c in own if c.startswith("learner.steps=")] == ["learner.steps=120"]


def test_table_gives_mean_and_sample_sd_of_gains_over_the_seeds_that_finished(tmp_path):
    _summary(tmp_path / "base-s0", 0.20, 0.30)
    _summary(tmp_path / "base-s1", 0.20, 0.40, wall=300.0)
    _summary(tmp_path / "sft100-s0", 0.40, 0.45)  # seed 1 not finished: one run, sd 0
    rows = levers.collect(tmp_path, ["base", "sft100", "kl"], [0, 1])
    assert [r["lever"] for r in rows] == ["base", "sft100"]
    text = levers.table(rows).splitlines()
    assert "| 2 | 0.200 ± 0.000 | 0.350 ± 0.071 | +0.150 ± 0.071 | +0.100, +0.200 | 200 s | GoToRedBall 0.35 |" in text[2]
    assert "| 1 | 0.400 ± 0.000 | 0.450 ± 0.000 | +0.050 ± 0.000 |" in text[3]


def test_an_unknown_lever_is_refused_with_the_known_ones(tmp_path, capsys):
    with pytest.raises(SystemExit):
        levers.main(["--levers", "base,bogus", "--out", str(tmp_path), "--table-only"])
    assert "unknown lever(s) bogus" in capsys.readouterr().err


@pytest.mark.parametrize("lever", sorted(levers.LEVERS))
def test_every_levers_overrides_make_a_valid_run_config(lever, tmp_path):
    from turnscale import conf

    cmd = levers._cmd(tmp_path, lever, 0, 40)
    cfg = conf.load(["experiment=run_babyai", *cmd[cmd.index("run") + 1:]])
    if lever.startswith("noise50"):
        assert cfg.run.warm_start.action_noise == 0.5
