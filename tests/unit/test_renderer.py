"""Renderer: incremental token streams equal the chat template over the whole conversation."""

from __future__ import annotations

import pytest

from turnscale.common.renderer import Renderer, RenderError
from tests.conftest import tiny_corpus
from turnscale.common.tinymodel import CHATML_TEMPLATE, build_tokenizer

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
LLAMA3_TRIM_TEMPLATE = LLAMA3_TEMPLATE.replace("message['content']", "(message['content'] | trim)")
COUNTING_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + ' ' + (messages | length | string) + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


@pytest.fixture(scope="module")
def chatml_tok():
    return build_tokenizer(tiny_corpus(200), 512)


@pytest.fixture(scope="module")
def llama3_tok():
    return build_tokenizer(
        tiny_corpus(200), 512, special_tokens=LLAMA3_SPECIALS, chat_template=LLAMA3_TEMPLATE,
        eos_token="<|eot_id|>", pad_token="<|end_of_text|>", bos_token="<|begin_of_text|>",
    )


ASSISTANT = ["Thought: go there.\nAction: move forward", "Thought: it is 42 steps away\nAction: turn left 7", "Action: done"]
OBS = ["You see a wall 3 steps ahead.", "Your goal: pick up the red ball 12", "ok"]


def play(renderer: Renderer, tok, *, eos_in_output: bool) -> tuple[list[int], list[int], list[dict]]:
    """Build the stream incrementally with canonical assistant tokens; returns ids, mask, messages."""
    messages = [{"role": "system", "content": "You are an agent 1."}, {"role": "user", "content": "Your goal: go to the red ball"}]
    ids = renderer.initial(messages)
    mask = [0] * len(ids)
    for k, (text, obs) in enumerate(zip(ASSISTANT, OBS)):
        out = tok.encode(text, add_special_tokens=False) + ([renderer.end_of_turn_id] if eos_in_output else [])
        prev = list(ids)
        ids += out
        mask += [1] * len(out)
        delta = renderer.extend(prev, out, eos_in_output, obs, messages=messages)
        ids += delta
        mask += [0] * len(delta)
        messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": obs}]
    return ids, mask, messages


@pytest.mark.parametrize("family", ["chatml", "llama3"])
@pytest.mark.parametrize("eos_in_output", [True, False])
def test_incremental_stream_equals_template_over_whole_conversation(family, eos_in_output, chatml_tok, llama3_tok):
    tok = chatml_tok if family == "chatml" else llama3_tok
    r = Renderer.for_tokenizer(tok, "auto")
    assert r.name == family
    ids, mask, messages = play(r, tok, eos_in_output=eos_in_output)
    full = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    assert ids == full
    # the mask is 1 exactly on the assistant tokens (the end-of-turn token only when the engine sampled it)
    sampled = [i for i, m in zip(ids, mask) if m]
    expected = []
    for text in ASSISTANT:
        expected += tok.encode(text, add_special_tokens=False) + ([r.end_of_turn_id] if eos_in_output else [])
    assert sampled == expected


def test_template_renderer_derives_the_same_delta_as_chatml(chatml_tok):
    a = play(Renderer.for_tokenizer(chatml_tok, "template"), chatml_tok, eos_in_output=True)
    b = play(Renderer.for_tokenizer(chatml_tok, "chatml"), chatml_tok, eos_in_output=True)
    assert a[0] == b[0]


def test_stop_token_is_the_end_of_turn_token(chatml_tok, llama3_tok):
    assert Renderer.for_tokenizer(chatml_tok).stop_token_ids == (chatml_tok.convert_tokens_to_ids("<|im_end|>"),)
    assert Renderer.for_tokenizer(llama3_tok).stop_token_ids == (llama3_tok.convert_tokens_to_ids("<|eot_id|>"),)


def test_template_that_counts_messages_is_detected(chatml_tok):
    tok = build_tokenizer(tiny_corpus(200), 512, chat_template=COUNTING_TEMPLATE)
    for name in ("chatml", "template"):
        r = Renderer.for_tokenizer(tok, name)
        with pytest.raises(RenderError, match="does not extend"):
            play(r, tok, eos_in_output=True)


def test_template_that_trims_content_is_detected_when_output_ends_in_whitespace(llama3_tok):
    tok = build_tokenizer(
        tiny_corpus(200), 512, special_tokens=LLAMA3_SPECIALS, chat_template=LLAMA3_TRIM_TEMPLATE,
        eos_token="<|eot_id|>", pad_token="<|end_of_text|>", bos_token="<|begin_of_text|>",
    )
    r = Renderer.for_tokenizer(tok)
    messages = [{"role": "user", "content": "go"}]
    prev = r.initial(messages)
    clean = tok.encode("Action: left", add_special_tokens=False) + [r.end_of_turn_id]
    r.extend(prev, clean, True, "ok", messages=messages)  # no whitespace: fine
    padded = tok.encode("Action: left\n", add_special_tokens=False) + [r.end_of_turn_id]
    with pytest.raises(RenderError):
        r.extend(prev, padded, True, "ok", messages=messages)


def test_stopped_on_eos_without_the_token_is_an_error(chatml_tok):
    r = Renderer.for_tokenizer(chatml_tok)
    with pytest.raises(RenderError):
        r.extend([1, 2], [5, 6], True, "obs")


def test_unknown_renderer_name_is_an_error(chatml_tok):
    with pytest.raises(RenderError, match="unknown renderer"):
        Renderer.for_tokenizer(chatml_tok, "mistral")
