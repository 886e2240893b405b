"""Incremental chat rendering: the conversation as one growing token stream.

An episode's stream is ``initial(messages)`` (system + task, with the generation
prompt), then for each turn the engine's sampled ids verbatim, then ``extend(...)``'s
delta: the end-of-turn token when the engine did not emit it, the user turn with the
observation, and the generation prompt.  Nothing is ever re-tokenised, so every prompt
extends the previous one token for token by construction.

What must be checked is that this stream is what the model's own chat template would
produce.  With ``messages`` (the conversation so far, assistant contents as decoded
text) every ``extend`` renders the template over the whole conversation and requires

    template(messages + [assistant, user], gen) == template(messages, gen) + content + delta_text

where ``delta_text`` is the delta this renderer emits (plus the end-of-turn token the
engine sampled).  A template that rewrites earlier turns, trims content, or counts turns
breaks this and raises ``RenderError`` (the episode ends ``render_error``; it is never
trained on).  ``initial`` uses the template's own text when the tokenizer has one.

Formats: ``chatml`` (Qwen), ``llama3``, and ``template`` (any template: the delta is the
template's own suffix, derived from the same comparison; needs ``messages``).
``for_tokenizer(tok, "auto")`` picks by the special tokens the template uses.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Sequence

from turnscale.protocol.errors import TurnscaleError


class RenderError(TurnscaleError):
    """The chat template and the incremental token stream disagree."""


@dataclass(frozen=True)
class ChatFormat:
    """The strings a template family uses (``{role}`` / ``{content}`` placeholders)."""

    name: str
    message: str
    """One message; must end with ``end_of_turn`` + ``after_turn``."""
    generation_prompt: str
    end_of_turn: str
    """The assistant's end-of-turn token text (the engine's stop token)."""
    after_turn: str = ""
    """Text the template puts after ``end_of_turn`` (ChatML: a newline)."""
    bos: str = ""


CHATML = ChatFormat(
    name="chatml",
    message="<|im_start|>{role}\n{content}<|im_end|>\n",
    generation_prompt="<|im_start|>assistant\n",
    end_of_turn="<|im_end|>",
    after_turn="\n",
)

LLAMA3 = ChatFormat(
    name="llama3",
    message="<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>",
    generation_prompt="<|start_header_id|>assistant<|end_header_id|>\n\n",
    end_of_turn="<|eot_id|>",
    bos="<|begin_of_text|>",
)

FORMATS = {"chatml": CHATML, "llama3": LLAMA3}


class Renderer:
    """Renders one model's conversations; shared by concurrent episodes (its only state is
    a bounded memo of template renders)."""

    MEMO_SIZE = 512

    def __init__(self, tokenizer: Any, fmt: ChatFormat | None, *, check: bool = True) -> None:
        self.tokenizer = tokenizer
        self._memo: collections.OrderedDict[tuple, str] = collections.OrderedDict()
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self.fmt = fmt
        self.check = check
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        eot = fmt.end_of_turn if fmt is not None else tokenizer.eos_token
        if eot is None:
            raise RenderError("the tokenizer has no eos token and the format names no end-of-turn token")
        eot_id = tokenizer.convert_tokens_to_ids(eot)
        if eot_id is None or eot_id == getattr(tokenizer, "unk_token_id", object()):
            raise RenderError(f"end-of-turn token {eot!r} is not in the tokenizer's vocabulary")
        self.end_of_turn = eot
        self.end_of_turn_id = int(eot_id)
        self.name = fmt.name if fmt is not None else "template"
        if fmt is None and not self.has_template:
            raise RenderError("renderer 'template' needs a tokenizer with a chat template")

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, name: str = "auto", *, check: bool = True) -> "Renderer":
        """``name``: ``chatml``, ``llama3``, ``template`` or ``auto`` (from the template's tokens)."""
        if name == "auto":
            tmpl = getattr(tokenizer, "chat_template", None) or ""
            vocab = tokenizer.get_vocab()
            if "<|im_start|>" in tmpl or (not tmpl and "<|im_start|>" in vocab):
                name = "chatml"
            elif "<|start_header_id|>" in tmpl or (not tmpl and "<|start_header_id|>" in vocab):
                name = "llama3"
            else:
                name = "template"
        if name == "template":
            return cls(tokenizer, None, check=check)
        if name not in FORMATS:
            raise RenderError(f"unknown renderer {name!r}; choose auto, chatml, llama3 or template")
        return cls(tokenizer, FORMATS[name], check=check)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Token ids that end an assistant turn (pass to ``GenerateRequest.stop_token_ids``)."""
        return (self.end_of_turn_id,)

    # -- rendering ---------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Text (special tokens included) -> ids, without the tokenizer adding anything."""
        if self._backend is not None:  # the fast tokenizer's own pipeline, minus the wrapper's overhead
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def template_text(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The template's text for ``messages`` (memoised: each turn's full render is the
        next turn's prefix render, and a group's episodes share their first prompt)."""
        key = (add_generation_prompt, tuple((m["role"], m["content"]) for m in messages))
        text = self._memo.get(key)
        if text is None:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
            self._memo[key] = text
            if len(self._memo) > self.MEMO_SIZE:
                self._memo.popitem(last=False)
        return text

    def initial(self, messages: list[dict]) -> list[int]:
        """The first prompt: ``messages`` (system + first user) and the generation prompt."""
        if self.has_template:
            text = self.template_text(messages)
        else:
            text = self.fmt.bos + "".join(self.fmt.message.format(role=m["role"], content=m["content"]) for m in messages) + self.fmt.generation_prompt
        return self.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def assistant_content(self, assistant_ids: Sequence[int], stopped_on_eos: bool) -> str:
        """The assistant message's content as the template sees it (without end-of-turn)."""
        ids = list(assistant_ids)
        if stopped_on_eos and ids and ids[-1] == self.end_of_turn_id:
            ids = ids[:-1]
        return self.decode(ids)

    def extend(
        self,
        prev_ids: Sequence[int],
        assistant_ids: Sequence[int],
        stopped_on_eos: bool,
        observation: str,
        messages: list[dict] | None = None,
    ) -> list[int]:
        """The delta tokens after ``prev_ids + assistant_ids`` for a user turn ``observation``.

        ``stopped_on_eos``: the engine's last sampled id is the end-of-turn token (so it is
        not emitted again).  ``messages``: the conversation ``prev_ids`` renders (assistant
        contents as ``assistant_content`` decodes them); when given and ``check`` is on,
        the template is verified over the whole conversation (``RenderError`` on a break).
        """
        if stopped_on_eos and (not assistant_ids or assistant_ids[-1] != self.end_of_turn_id):
            raise RenderError("stopped_on_eos is set but the assistant output does not end with the end-of-turn token")
        if self.fmt is None:
            if messages is None:
                raise RenderError("renderer 'template' needs the conversation (messages) to derive each delta")
            delta_text = self._template_delta(messages, assistant_ids, stopped_on_eos, observation)
        else:
            fmt = self.fmt
            delta_text = ("" if stopped_on_eos else fmt.end_of_turn) + fmt.after_turn
            delta_text += fmt.message.format(role="user", content=observation) + fmt.generation_prompt
            if self.check and messages is not None and self.has_template:
                self._verify(messages, assistant_ids, stopped_on_eos, observation, delta_text)
        if not (stopped_on_eos or delta_text.startswith(self.end_of_turn)):
            raise RenderError("the delta does not start at a special-token boundary; tokens could merge differently")
        return self.encode(delta_text)

    def _conversation_texts(self, messages, assistant_ids, stopped_on_eos, observation) -> tuple[str, str, str]:
        content = self.assistant_content(assistant_ids, stopped_on_eos)
        before = self.template_text(messages)
        after = self.template_text(list(messages) + [{"role": "assistant", "content": content}, {"role": "user", "content": observation}])
        return before, content, after

    def _verify(self, messages, assistant_ids, stopped_on_eos, observation, delta_text: str) -> None:
        before, content, after = self._conversation_texts(messages, assistant_ids, stopped_on_eos, observation)
        ours = before + content + (self.end_of_turn if stopped_on_eos else "") + delta_text
        if after != ours:
            raise RenderError(_mismatch(after, ours, len(messages)))

    def _template_delta(self, messages, assistant_ids, stopped_on_eos, observation) -> str:
        before, content, after = self._conversation_texts(messages, assistant_ids, stopped_on_eos, observation)
        head = before + content
        if not after.startswith(head):
            raise RenderError(_mismatch(after, head, len(messages)))
        delta = after[len(head) :]
        if stopped_on_eos:
            if not delta.startswith(self.end_of_turn):
                raise RenderError(f"the template does not end the assistant turn with {self.end_of_turn!r}")
            delta = delta[len(self.end_of_turn) :]
        return delta


def _mismatch(template: str, ours: str, n_messages: int) -> str:
    i = next((k for k, (a, b) in enumerate(zip(template, ours)) if a != b), min(len(template), len(ours)))
    return (
        f"chat template does not extend the previous prompt after {n_messages} messages: at char {i} "
        f"the template has {template[max(0, i - 20):i + 30]!r}, the incremental stream has {ours[max(0, i - 20):i + 30]!r}"
    )
