from turnscale.common.parsing import ACTION_LINE_HINT, parse_action_line, parse_backticks, parse_tags, parser_for
from turnscale.common.prompts import initial_messages, instruction

import pytest


def test_action_line_takes_text_after_action_to_line_end():
    r = parse_action_line("Thought: the ball is ahead.\nAction: move forward  \nmore text")
    assert r.ok and r.action == "move forward"


@pytest.mark.parametrize("text", ["Thought: nothing to do", "Action: a\nAction: b", "Thought: x\nAction:   \n"])
def test_action_line_failures_give_the_format_hint(text):
    r = parse_action_line(text)
    assert not r.ok and r.action == "" and r.hint == ACTION_LINE_HINT


def test_tags_pass_the_raw_first_tag_to_the_env():
    assert parse_tags("think <search> capital of france </search> then <answer>x</answer>").action == "<search> capital of france </search>"
    assert parse_tags("<answer>Paris</answer>").action == "<answer>Paris</answer>"
    assert parse_tags("<answer>\nParis\n</answer>").ok
    assert not parse_tags("Paris").ok and "<search>" in parse_tags("Paris").hint
    assert not parse_tags("<answer> </answer>").ok


def test_backticks_take_the_first_block():
    assert parse_backticks("I will click.\n```click [12]```\n```stop [x]```").action == "click [12]"
    assert not parse_backticks("click [12]").ok


def test_every_env_has_a_parser_and_an_instruction():
    for env in ("babyai", "textcraft", "sciworld", "searchqa", "webarena"):
        assert callable(parser_for(env)) and instruction(env)
    with pytest.raises(ValueError):
        parser_for("chess")


def test_initial_messages_put_the_instruction_in_a_system_message():
    assert initial_messages("do it", "obs") == [{"role": "system", "content": "do it"}, {"role": "user", "content": "obs"}]
    assert initial_messages("", "obs") == [{"role": "user", "content": "obs"}]
