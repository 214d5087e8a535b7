"""Text in and out of the server: chats rendered into prompt ids as fine-tuning rendered them, and
generated ids turned back into text as they come, held back where a stop string may be starting.

A chat's prompt is tokenized the way engine.data.finetune tokenized its training chats (piece by
piece of the template's render, the tokenizer's end-of-document id after each assistant turn where
the template asks for it), ending with the text that precedes an assistant turn (the template's
generation prompt): the model sees at serving time what it saw before each answer it was trained on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from megatrain.engine.data.chat_templates import ChatTemplate, ChatTemplateError
from megatrain.engine.data.tokenizers import Tokenizer


def encode_chat_prompt(
    messages: Sequence[Mapping[str, Any]], template: ChatTemplate, tokenizer: Tokenizer
) -> list[int]:
    """The prompt ids of a chat whose next turn the model writes (ChatTemplateError for a chat the
    template cannot render, or whose render with the generation prompt does not extend it)."""
    pieces = template.spans(messages)
    while pieces and not pieces[-1][1]:  # the text after the last assistant turn is re-rendered below
        pieces.pop()
    done = sum(len(text) for text, _ in pieces)
    prompt = template.render(messages, add_generation_prompt=True)
    if prompt[:done] != "".join(text for text, _ in pieces):
        raise ChatTemplateError(f"chat template {template.name}: the generation prompt rewrites the chat")
    ids: list[int] = []
    for text, assistant in pieces:
        ids += tokenizer.encode(text)
        if assistant and template.eod_after_assistant:
            ids.append(tokenizer.eod)
    return ids + tokenizer.encode(prompt[done:])


class TextStream:
    """One sequence's generated text: `push(id)` returns the text that is now final (none while
    the decode ends in an incomplete character, or while its end may begin a stop string) and
    whether a stop string appeared (the text then ends before it); `rest()` what was held back."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        """Characters of `text` already returned."""
        self.stopped = False

    def push(self, token: int) -> tuple[str, bool]:
        self.ids.append(token)
        # The whole continuation decoded again: a token's text can depend on its neighbours (byte
        # fallbacks, leading spaces), and the sequences a server holds are short next to a decode.
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # a character whose remaining bytes are in the next tokens
            return "", False
        self.text = text
        hit = self._first_stop()
        if hit is not None:
            self.text, self.stopped = text[:hit], True
            return self._take(len(self.text)), True
        return self._take(len(text) - self._held(text)), False

    def rest(self) -> str:
        """Everything not yet returned (the sequence ended): an incomplete last character too."""
        if not self.stopped:
            self.text = self.tokenizer.decode(self.ids)
            hit = self._first_stop()
            self.text = self.text if hit is None else self.text[:hit]
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        out = self.text[self.sent : upto]
        self.sent = max(self.sent, upto)
        return out

    def _first_stop(self) -> int | None:
        hits = []
        for s in self.stop:
            i = self.text.find(s, max(0, self.sent - len(s) + 1))
            if i >= 0:
                hits.append(i)
        return min(hits) if hits else None

    def _held(self, text: str) -> int:
        """How many trailing characters could be the start of a stop string."""
        held = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:k]):
                    held = k
                    break
        return held
