"""WebArena action grammar: every action kind parses, round-trips, and bad ones explain why."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from turnscale.envhub.webarena_actions import ActionError, WebAction, extract_action, format_action, parse_action

GOOD = {
    "click [12]": WebAction("click", element_id=12),
    "click[12]": WebAction("click", element_id=12),
    "hover [7]": WebAction("hover", element_id=7),
    "type [164] [restaurants near CMU] [1]": WebAction("type", element_id=164, text="restaurants near CMU"),
    "type [164] [hello] [0]": WebAction("type", element_id=164, text="hello", enter=False),
    "type [5] [no flag]": WebAction("type", element_id=5, text="no flag"),
    "press [Ctrl+v]": WebAction("press", text="Ctrl+v"),
    "scroll [down]": WebAction("scroll", direction="down"),
    "scroll up": WebAction("scroll", direction="up"),
    "new_tab": WebAction("new_tab"),
    "tab_focus [2]": WebAction("tab_focus", tab=2),
    "close_tab": WebAction("close_tab"),
    "goto [http://homepage.com/a?b=1]": WebAction("goto", text="http://homepage.com/a?b=1"),
    "go_back": WebAction("go_back"),
    "go_forward": WebAction("go_forward"),
    "stop [N/A]": WebAction("stop", text="N/A"),
    "stop []": WebAction("stop", text=""),
    "stop": WebAction("stop", text=""),
}


@pytest.mark.parametrize("text,expected", list(GOOD.items()))
def test_valid_actions_parse_and_round_trip(text, expected):
    a = parse_action(text)
    assert a == expected
    assert parse_action(format_action(a)) == a


@pytest.mark.parametrize("text,why", [
    ("", "Empty"), ("jump [3]", "Unknown action 'jump'"), ("click [abc]", "numeric id"),
    ("click 12", "click [id]"), ("type [x] [t] [1]", "type [id] [text] [0|1]"), ("scroll [left]", "scroll [down]"),
    ("tab_focus [one]", "tab_index"), ("goto []", "goto [url]"), ("go_back [1]", "takes no parameters"),
    ("press []", "press [key_comb]"), ("click [12] and then [13]", "click [id]"),
])
def test_invalid_actions_raise_an_explanation(text, why):
    with pytest.raises(ActionError, match=None) as e:
        parse_action(text)
    assert why in str(e.value)


def test_action_is_taken_from_the_first_backtick_block():
    reply = "Let's think step-by-step. ... In summary, the next action I will perform is ```click [3]``` then ```stop```"
    assert extract_action(reply) == "click [3]"
    assert extract_action("  go_back \n") == "go_back"


@given(st.text(max_size=60))
def test_parser_never_fails_with_anything_but_action_error(text):
    try:
        a = parse_action(text)
    except ActionError:
        return
    assert parse_action(format_action(a)) == a
