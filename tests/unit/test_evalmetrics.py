"""Eval metrics on hand-computed numbers: unbiased Pass@k, Avg@k, grouping, error exclusion."""

from __future__ import annotations

import pytest

from turnscale.evalmetrics import EpisodeResult, pass_at_k, report_rows, summarize


def ep(env, cat, idx, sample, reward, success, turns=5, finish="done", ckpt="A", limit=10):
    return EpisodeResult(checkpoint=ckpt, env=env, category=cat, data_idx=idx, sample=sample, reward=reward,
                         success=success, num_turns=turns, turn_limit=limit, finish_reason=finish)


@pytest.mark.parametrize("n,c,k,want", [
    (4, 1, 2, 0.5),          # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (4, 2, 1, 0.5),          # c/n for k = 1
    (4, 2, 2, 5 / 6),        # 1 - C(2,2)/C(4,2) = 1 - 1/6
    (4, 2, 3, 1.0),          # n - c < k
    (4, 0, 4, 0.0),
    (3, 1, 3, 1.0),          # n == k: AgentGym-RL's max score > 0
    (10, 3, 5, 1 - 21 / 252),
])
def test_pass_at_k_unbiased_estimator(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want)


@pytest.mark.parametrize("n,c,k", [(3, 1, 4), (3, 4, 1), (3, 1, 0)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def babyai_results():
    rs = []
    for s, (r, ok, t) in enumerate([(0.9, True, 2), (0, False, 5), (0, False, 5), (0, False, 5)]):
        rs.append(ep("babyai", "L1", 0, s, r, ok, t))
    for s, (r, ok, t) in enumerate([(0.5, True, 3), (0.7, True, 4), (0, False, 5), (0, False, 5)]):
        rs.append(ep("babyai", "L1", 1, s, r, ok, t))
    for s in range(4):
        rs.append(ep("babyai", "L2", 40, s, 0.0, False, 5))
    rs.append(ep("babyai", "L2", 40, 4, 0.0, False, 1, finish="env_error"))
    rs.append(ep("babyai", "L1", 1, 4, 0.0, False, 1, finish="aborted"))
    return rs


def test_rows_per_category_and_env_match_hand_computed_numbers():
    rows = {(r.env, r.category): r for r in report_rows(babyai_results(), ks=[1, 2, 4, 8])}
    l1 = rows[("babyai", "L1")]
    assert (l1.tasks, l1.episodes, l1.errors, l1.samples_per_task) == (2, 8, 1, 4)
    assert l1.success == pytest.approx(3 / 8)
    assert l1.mean_reward == pytest.approx(2.1 / 8)
    assert l1.mean_turns == pytest.approx(34 / 8)
    assert l1.avg_at_k[1] == l1.avg_at_k[4] == pytest.approx((0.225 + 0.3) / 2)
    assert l1.pass_at_k[1] == pytest.approx((0.25 + 0.5) / 2)
    assert l1.pass_at_k[2] == pytest.approx((0.5 + 5 / 6) / 2)
    assert l1.pass_at_k[4] == pytest.approx(1.0)
    assert l1.pass_at_k[8] is None and l1.avg_at_k[8] is None  # only 4 samples per task
    l2 = rows[("babyai", "L2")]
    assert (l2.tasks, l2.episodes, l2.errors, l2.success, l2.pass_at_k[4]) == (1, 4, 1, 0.0, 0.0)
    env = rows[("babyai", "")]
    assert (env.tasks, env.episodes, env.errors) == (3, 12, 2)
    assert env.success == pytest.approx(0.25) and env.mean_reward == pytest.approx(2.1 / 12)
    assert env.pass_at_k[2] == pytest.approx((0.5 + 5 / 6 + 0) / 3)
    assert ("", "") not in rows  # one env: no all-envs row


def test_pass_rule_reward_counts_partial_scores_and_success_rule_does_not():
    rs = [ep("sciworld", "boil", 7, 0, 0.3, False), ep("sciworld", "boil", 7, 1, 0.0, False)]
    by_reward = summarize("A", 10, "sciworld", "", rs, [1, 2], pass_on="reward")
    by_success = summarize("A", 10, "sciworld", "", rs, [1, 2], pass_on="success")
    assert by_reward.pass_at_k == {1: pytest.approx(0.5), 2: pytest.approx(1.0)}
    assert by_success.pass_at_k == {1: 0.0, 2: 0.0}
    assert by_reward.success == 0.0


def test_several_envs_checkpoints_and_turn_limits_get_their_own_rows_in_order():
    rs = babyai_results() + [ep("textcraft", "depth1", 3, s, 1.0, True, 2) for s in range(2)]
    rs += [ep("babyai", "L1", 0, s, 0.0, False, ckpt="B", limit=5) for s in range(2)]
    rs += [ep("babyai", "L1", 0, s, 0.8, True, ckpt="B", limit=20) for s in range(2)]
    rows = report_rows(rs, ks=[1, 2, 4])
    keys = [(r.checkpoint, r.turn_limit, r.env, r.category) for r in rows]
    assert keys == [("A", 10, "babyai", ""), ("A", 10, "babyai", "L1"), ("A", 10, "babyai", "L2"),
                    ("A", 10, "textcraft", ""), ("A", 10, "textcraft", "depth1"), ("A", 10, "", ""),
                    ("B", 5, "babyai", ""), ("B", 5, "babyai", "L1"), ("B", 5, "", ""),
                    ("B", 20, "babyai", ""), ("B", 20, "babyai", "L1"), ("B", 20, "", "")]
    all_a = rows[5]
    assert all_a.tasks == 4 and all_a.success == pytest.approx(5 / 14)
    assert all_a.pass_at_k[4] is None and all_a.pass_at_k[2] is not None  # textcraft has only 2 samples


def test_empty_group_gives_none_not_a_crash():
    row = summarize("A", 10, "babyai", "", [ep("babyai", "L1", 0, 0, 0, False, finish="env_error")], [1])
    assert row.episodes == 0 and row.success is None and row.pass_at_k[1] is None and row.errors == 1


def test_from_record_reads_the_learner_format_and_names_a_missing_field():
    rec = {"env": "babyai", "data_idx": 3, "category": "L1", "episode": 2, "reward": 0.5, "success": True,
           "turns": [{}, {}], "turn_limit": 6, "finish_reason": "done"}
    r = EpisodeResult.from_record(rec, "ckpt")
    assert (r.checkpoint, r.sample, r.num_turns, r.turn_limit) == ("ckpt", 2, 2, 6)
    with pytest.raises(ValueError, match="reward"):
        EpisodeResult.from_record({"env": "babyai", "data_idx": 1, "success": True})


def category_less_results(tasks: int = 40, samples: int = 1):
    """What an eval against AgentGym's own BabyAI server records: its reset sends no category.
    Task ``i`` passes in its first ``i % (samples + 1)`` samples."""
    return [ep("babyai", "", i, s, 1.0 if s < i % (samples + 1) else 0.0, s < i % (samples + 1))
            for i in range(tasks) for s in range(samples)]


def test_a_result_without_category_is_counted_once():
    """40 episodes, one per task: the env row says 40 episodes and 1 sample per task (it said 80 and
    2: each result was added to its category group and to the env group, the same key)."""
    rows = report_rows(category_less_results(40, 1), ks=[1, 2])
    assert [(r.env, r.category) for r in rows] == [("babyai", "")]
    (row,) = rows
    assert (row.tasks, row.episodes, row.samples_per_task) == (40, 40, 1)
    assert row.success == pytest.approx(20 / 40) and row.pass_at_k[1] == pytest.approx(0.5)
    assert row.pass_at_k[2] is None and row.avg_at_k[2] is None  # one sample per task: Pass@2 not estimable


def test_pass_at_k_over_category_less_results_uses_the_real_sample_counts():
    """Two samples per task, task i passes in i % 3 of them: Pass@2 over (n=2, c=0|1|2)."""
    rows = report_rows(category_less_results(6, 2), ks=[1, 2])
    (row,) = rows
    assert (row.tasks, row.episodes, row.samples_per_task) == (6, 12, 2)
    per_task_c = [i % 3 for i in range(6)]
    assert row.pass_at_k[1] == pytest.approx(sum(c / 2 for c in per_task_c) / 6)
    assert row.pass_at_k[2] == pytest.approx(sum(pass_at_k(2, c, 2) for c in per_task_c) / 6)


def test_a_mix_of_envs_with_and_without_categories_counts_every_result_once_per_row():
    rs = category_less_results(4, 2) + [ep("textcraft", "depth1", 3, s, 1.0, True, 2) for s in range(2)]
    rows = {(r.env, r.category): r for r in report_rows(rs, ks=[1, 2])}
    assert set(rows) == {("babyai", ""), ("textcraft", ""), ("textcraft", "depth1"), ("", "")}
    assert rows[("babyai", "")].episodes == 8 and rows[("textcraft", "")].episodes == 2
    assert rows[("", "")].episodes == 10 and rows[("", "")].samples_per_task == 2


def test_turnscale_eval_reports_category_less_records_once(tmp_path, capsys):
    """Through the command (``turnscale eval --from-jsonl``) on records shaped as an eval against
    AgentGym's BabyAI server writes them (``"category": ""``)."""
    import json

    from turnscale import evaluate

    recs = tmp_path / "trajectories.jsonl"
    recs.write_text("".join(json.dumps({"checkpoint": "m", "env": r.env, "category": "", "data_idx": r.data_idx,
                                        "sample": r.sample, "reward": r.reward, "success": r.success, "num_turns": 3,
                                        "turn_limit": 5, "finish_reason": "done"}) + "\n"
                            for r in category_less_results(40, 1)))
    assert evaluate.main(["--from-jsonl", str(recs), "--k", "1", "--out", str(tmp_path / "out")]) == 0
    doc = json.loads((tmp_path / "out" / "eval.json").read_text())
    (row,) = doc["rows"]
    assert (row["env"], row["category"], row["episodes"], row["samples_per_task"]) == ("babyai", "", 40, 1)
    capsys.readouterr()
