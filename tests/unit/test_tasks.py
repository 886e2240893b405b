import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnscale.learner.tasks import TaskCursor, TaskSpecError, TaskStream, parse_task_spec
from turnscale.protocol.messages import Task


def test_range_spec_gives_every_index_once():
    tasks = parse_task_spec("3:7", "babyai")
    assert [t.data_idx for t in tasks] == [3, 4, 5, 6]
    assert all(t.env == "babyai" and t.split == "train" for t in tasks)


def test_agentgym_item_file_and_int_file_are_read(tmp_path):
    p = tmp_path / "babyai_train.json"
    p.write_text(json.dumps([{"item_id": "babyai_17"}, {"item_id": "babyai_3"}]))
    tasks = parse_task_spec(str(p), "babyai", "test")
    assert [(t.data_idx, t.task_id, t.split) for t in tasks] == [(17, "babyai_17", "test"), (3, "babyai_3", "test")]
    q = tmp_path / "ints.json"
    q.write_text("[5, 9]")
    assert [t.data_idx for t in parse_task_spec(str(q), "babyai")] == [5, 9]


@pytest.mark.parametrize("content", ['[{"item_id": "textcraft_1"}]', "[]", '{"a": 1}', "[-1]", '["x"]', "not json"])
def test_bad_task_files_raise_typed_error(tmp_path, content):
    p = tmp_path / "t.json"
    p.write_text(content)
    with pytest.raises(TaskSpecError):
        parse_task_spec(str(p), "babyai")


@pytest.mark.parametrize("spec", ["", "5:5", "a:b", "/no/such/file.json"])
def test_bad_specs_raise_typed_error(spec):
    with pytest.raises(TaskSpecError):
        parse_task_spec(spec, "babyai")


def test_each_epoch_is_a_permutation_and_epochs_differ():
    tasks = parse_task_spec("0:20", "babyai")
    s = TaskStream(tasks, seed=1)
    e0 = [s.next().data_idx for _ in range(20)]
    e1 = [s.next().data_idx for _ in range(20)]
    assert sorted(e0) == sorted(e1) == list(range(20))
    assert e0 != e1
    assert s.cursor == TaskCursor(1, 20)
    assert e0 == [TaskStream(tasks, seed=1).next().data_idx for _ in range(1)] + e0[1:]


def test_same_seed_same_order_other_seed_other_order():
    tasks = parse_task_spec("0:50", "babyai")
    a = [TaskStream(tasks, seed=3).next().data_idx for _ in range(1)]
    s1, s2, s3 = TaskStream(tasks, seed=3), TaskStream(tasks, seed=3), TaskStream(tasks, seed=4)
    o1 = [s1.next().data_idx for _ in range(50)]
    assert o1 == [s2.next().data_idx for _ in range(50)]
    assert o1 != [s3.next().data_idx for _ in range(50)]
    assert o1[0] == a[0]


def test_reissued_tasks_come_first_in_order():
    tasks = parse_task_spec("0:10", "babyai")
    s = TaskStream(tasks, seed=0)
    first = s.next()
    s.reissue(Task(env="babyai", data_idx=99))
    s.reissue(first)
    assert s.next().data_idx == 99
    assert s.next() == first
    assert s.cursor.position == 1  # re-issues do not move the cursor


@pytest.mark.parametrize("cut", [0, 1, 7, 10, 13, 25])
def test_state_round_trip_continues_exactly(cut):
    tasks = parse_task_spec("0:10", "babyai")
    ref = TaskStream(tasks, seed=5)
    s = TaskStream(tasks, seed=5)
    for _ in range(cut):
        s.next()
        ref.next()
    in_flight = [Task(env="babyai", data_idx=42)]
    restored = TaskStream.from_state(tasks, s.state(extra_reissue=in_flight))
    assert restored.next().data_idx == 42
    assert [restored.next() for _ in range(30)] == [ref.next() for _ in range(30)]


def test_state_from_other_task_list_is_refused():
    s = TaskStream(parse_task_spec("0:10", "babyai"))
    with pytest.raises(TaskSpecError):
        TaskStream.from_state(parse_task_spec("0:11", "babyai"), s.state())



@settings(max_examples=80, deadline=None)
@given(st.lists(st.sampled_from(["next", "reissue", "checkpoint"]), max_size=120), st.integers(0, 3))
def test_no_task_is_lost_across_reissues_and_checkpoints(ops, seed):
    """Whatever the interleaving, the tasks handed out and not given back are exactly the
    epoch permutations read in order (each re-issued task is handed out again)."""
    tasks = parse_task_spec("0:7", "babyai")
    s = TaskStream(tasks, seed=seed)
    out_now = []  # tasks currently held (handed out, not given back)
    for op in ops:
        if op == "next":
            t = s.next()
            out_now.append(t)
        elif op == "reissue" and out_now:
            s.reissue(out_now.pop(0))
        elif op == "checkpoint":
            s = TaskStream.from_state(tasks, s.state(extra_reissue=out_now))
            out_now = []
    while s.pending_reissue:
        out_now.append(s.next())
    fresh = TaskStream(tasks, seed=seed)
    expected = [fresh.next() for _ in range(s.cursor.epoch * 7 + s.cursor.position)]
    assert sorted(t.data_idx for t in out_now) == sorted(t.data_idx for t in expected)  # as multisets


@pytest.mark.parametrize("spec", ["3:7", " 2 : 5 ", "3,5,9", "5,1,5,2", "7", "", "5:5", "4:2", "-1:3", "a:b", "1-3",
                                  "3,,5", "/no/such/file.json", "FILE:items", "FILE:ints", "FILE:mixed-case",
                                  "FILE:dupes", "FILE:other-env", "FILE:bad"])
def test_learner_and_eval_parse_every_spec_the_same_way(tmp_path, spec):
    """One parser (``conf.tasks``): the learner's tasks and eval's indices agree on every spec
    (eval keeps the first of duplicates), and both refuse the same specs with the same error."""
    from turnscale import evaltasks

    files = {"items": [{"item_id": "babyai_17"}, {"item_id": "babyai_3"}], "ints": [4, 2],
             "mixed-case": [{"item_id": "BabyAI_8"}, 9], "dupes": [3, 3, 1], "other-env": [{"item_id": "textcraft_1"}],
             "bad": {"a": 1}}
    if spec.startswith("FILE:"):
        name = spec.removeprefix("FILE:")
        (tmp_path / f"{name}.json").write_text(json.dumps(files[name]))
        spec = str(tmp_path / f"{name}.json")
    try:
        learner = [t.data_idx for t in parse_task_spec(spec, "babyai")]
    except TaskSpecError as exc:
        with pytest.raises(evaltasks.TaskSpecError) as got:
            evaltasks.parse_task_spec(spec, "babyai")
        assert evaltasks.TaskSpecError is TaskSpecError
        assert str(got.value) == str(exc).replace("babyai/train", "babyai")
        return
    assert evaltasks.parse_task_spec(spec, "babyai") == list(dict.fromkeys(learner))
