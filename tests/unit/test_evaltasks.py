"""Task specs for eval: ranges, lists, AgentGym-RL id files."""

from __future__ import annotations

import json

import pytest

from turnscale.evaltasks import TaskSpecError, parse_task_spec


def test_ranges_and_lists():
    assert parse_task_spec("3:6", "babyai") == [3, 4, 5]
    assert parse_task_spec("5,1,5,2", "babyai") == [5, 1, 2]


def test_agentgym_rl_id_file_is_accepted_as_it_is(tmp_path):
    f = tmp_path / "babyai_test.json"
    f.write_text(json.dumps([{"item_id": "babyai_17"}, {"item_id": "babyai_3"}, {"item_id": "babyai_17"}]))
    assert parse_task_spec(str(f), "babyai") == [17, 3]
    g = tmp_path / "ints.json"
    g.write_text("[4, 2]")
    assert parse_task_spec(str(g), "textcraft") == [4, 2]


@pytest.mark.parametrize("content,match", [
    ('[{"item_id": "textcraft_4"}]', "not 'babyai'"),
    ('[{"id": 4}]', "entry 0"),
    ('{"item_id": "babyai_1"}', "non-empty JSON list"),
    ("[not json", "not a readable JSON"),
])
def test_bad_id_files_say_what_is_wrong(tmp_path, content, match):
    f = tmp_path / "ids.json"
    f.write_text(content)
    with pytest.raises(TaskSpecError, match=match):
        parse_task_spec(str(f), "babyai")


@pytest.mark.parametrize("spec", ["", "5:5", "nope.json", "1-3"])
def test_unusable_specs_raise(spec):
    with pytest.raises(TaskSpecError):
        parse_task_spec(spec, "babyai")
