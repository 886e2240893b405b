import json

import numpy as np
import pytest

from turnscale.learner.sft_data import SFTDataError, conversation_to_episode, load_sft_groups


@pytest.fixture(scope="module")
def renderer(tiny_model_dir):
    from transformers import AutoTokenizer

    from turnscale.common.renderer import Renderer

    return Renderer.for_tokenizer(AutoTokenizer.from_pretrained(tiny_model_dir))


CONV = [
    {"role": "system", "content": "You are an agent."},
    {"role": "user", "content": "Your goal: go to the red ball"},
    {"role": "assistant", "content": "Action: turn left"},
    {"role": "user", "content": "You see a red ball 1 2 steps ahead"},
    {"role": "assistant", "content": "Action: go to red ball 1"},
]


def test_stream_equals_template_over_whole_conversation_and_mask_is_assistant_only(renderer):
    ep = conversation_to_episode(renderer, CONV, reward=0.8, success=True)
    whole = renderer.template_text(CONV, add_generation_prompt=False)
    assert renderer.decode(ep.token_ids.tolist()) == whole.rstrip("\n") or renderer.decode(ep.token_ids.tolist()) == whole
    sampled = renderer.decode(ep.token_ids[ep.loss_mask == 1].tolist())
    assert sampled == "Action: turn left<|im_end|>Action: go to red ball 1<|im_end|>"
    assert [t.output_text for t in ep.turns] == ["Action: turn left", "Action: go to red ball 1"]
    assert ep.prompt_len == len(renderer.initial(CONV[:2]))
    assert ep.success and ep.reward == pytest.approx(0.8) and ep.finish_reason == "done"
    assert np.all(ep.versions[ep.loss_mask == 0] == -1)


def test_conversation_without_assistant_or_out_of_order_is_rejected(renderer):
    with pytest.raises(SFTDataError, match="assistant"):
        conversation_to_episode(renderer, CONV[:2])
    with pytest.raises(SFTDataError, match="expected a user message"):
        conversation_to_episode(renderer, CONV[:3] + [CONV[2]])


def test_file_errors_name_the_line(renderer, tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": CONV, "env": "babyai", "data_idx": 3}) + "\n" + "{oops\n")
    with pytest.raises(SFTDataError, match=r"c.jsonl:2"):
        load_sft_groups(path, renderer)
    path.write_text(json.dumps({"messages": CONV, "env": "babyai", "data_idx": 3}) + "\n")
    (g,) = load_sft_groups(path, renderer)
    assert g.task.data_idx == 3 and len(g.episodes) == 1
    assert load_sft_groups(path, renderer, max_tokens=5) == []
