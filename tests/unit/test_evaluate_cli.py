"""``turnscale eval`` report mode end to end: JSONL in -> table, eval.json, report.md, PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.sample_runs import write_run_dir
from turnscale.evalmetrics import EpisodeResult, report_rows
from turnscale.evaluate import main


def test_report_from_recorded_episodes_writes_json_markdown_and_plots(tmp_path, capsys):
    base = write_run_dir(tmp_path / "base", seed=1, steps=6, group_size=4)
    rl = write_run_dir(tmp_path / "rl", seed=2, steps=6, group_size=4)
    out = tmp_path / "out"
    rc = main(["--from-jsonl", f"{base.path}/trajectories.jsonl=base", "--from-jsonl", f"{rl.path}/trajectories.jsonl=rl",
               "--k", "1,2", "--out", str(out), "--json", str(tmp_path / "copy.json"), "--markdown", str(tmp_path / "r.md")])
    assert rc == 0
    doc = json.loads((out / "eval.json").read_text())
    assert doc == json.loads((tmp_path / "copy.json").read_text())
    assert doc["checkpoints"] == ["base", "rl"] and doc["turns"] == [4, 6] and doc["k"] == [1, 2]
    want = report_rows([EpisodeResult.from_record(e, "base") for e in base.episodes]
                       + [EpisodeResult.from_record(e, "rl") for e in rl.episodes], [1, 2])
    assert len(doc["rows"]) == len(want)
    for got, w in zip(doc["rows"], want):
        assert (got["checkpoint"], got["turn_limit"], got["env"], got["category"]) == (w.checkpoint, w.turn_limit, w.env, w.category)
        assert got["success"] == pytest.approx(w.success) and got["pass_at_k"]["1"] == pytest.approx(w.pass_at_k[1])
    for png in ("turn_scaling.png", "pass_at_k.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    md = (out / "report.md").read_text()
    assert "| checkpoint | turns | env |" in md and "![turn_scaling](turn_scaling.png)" in md
    assert "unbiased" in md
    printed = capsys.readouterr()
    assert "Pass@2 %" in printed.out and "skipped 3 malformed" in printed.err


def test_report_without_a_sweep_draws_no_plots(tmp_path):
    run = write_run_dir(tmp_path / "r", seed=1, turn_schedule=(5,), malformed=False)
    assert main(["--from-jsonl", str(run.path / "trajectories.jsonl"), "--out", str(tmp_path / "o")]) == 0
    assert not (tmp_path / "o" / "turn_scaling.png").exists() and not (tmp_path / "o" / "pass_at_k.png").exists()
    doc = json.loads((tmp_path / "o" / "eval.json").read_text())
    assert doc["checkpoints"] == ["r"]


@pytest.mark.parametrize("argv,msg", [
    ([], "nothing to evaluate"),
    (["--from-jsonl", "/nonexistent.jsonl"], "no such file"),
    (["--from-jsonl", "x.jsonl", "--k", "0"], "--k"),
    (["--model", "m", "--k", "4", "--samples", "2"], "fewer than the largest k"),
])
def test_usage_errors_exit_2_with_a_message(argv, msg, capsys, tmp_path):
    assert main(argv + ["--out", str(tmp_path)]) == 2
    assert msg in capsys.readouterr().err


def test_run_mode_with_a_missing_model_folder_says_so(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "nope"), "--tasks", "0:2", "--out", str(tmp_path / "o")]) == 2
    assert "no such folder" in capsys.readouterr().err


def test_model_paths_resolve_to_hf_folders_in_checkpoints(tmp_path):
    from turnscale.evalrun import EvalRunError, resolve_model_dir

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert resolve_model_dir(str(hf)) == str(hf)
    root = tmp_path / "ckpts"
    for step in (50, 100, 7):
        (root / f"step-{step:08d}" / "model").mkdir(parents=True)
        (root / f"step-{step:08d}" / "model" / "config.json").write_text("{}")
    (root / ".tmp-step-00000200-ab" / "model").mkdir(parents=True)
    assert resolve_model_dir(str(root)) == str(root / "step-00000100" / "model")
    assert resolve_model_dir(str(root / "step-00000050")) == str(root / "step-00000050" / "model")
    with pytest.raises(EvalRunError, match="no config.json"):
        resolve_model_dir(str(tmp_path))


def test_a_sharded_checkpoint_is_exported_once_and_its_export_evaluated(tmp_path, monkeypatch):
    """``learner.strategy=fsdp`` checkpoints keep the weights in shards: eval exports the policy
    to ``step-N/hf`` (the real ``export_hf`` is checked in tests/integration/test_trainer_fsdp.py)."""
    from turnscale.evalrun import resolve_model_dir
    from turnscale.learner import checkpoint

    step = tmp_path / "ckpts" / "step-00000003"
    (step / "model").mkdir(parents=True)
    (step / "model" / "config.json").write_text("{}")
    (step / "sharded").mkdir()
    calls = []

    def fake_export(path, out, dtype="float32"):
        calls.append(path)
        (Path(out) / "config.json").write_text("{}")
        return out

    monkeypatch.setattr(checkpoint, "export_hf", fake_export)
    assert resolve_model_dir(str(tmp_path / "ckpts")) == str(step / "hf")
    assert resolve_model_dir(str(step)) == str(step / "hf")
    assert calls == [str(step)]  # exported once, then reused
    assert sorted(p.name for p in step.iterdir()) == ["hf", "model", "sharded"]  # no temporary folder left
