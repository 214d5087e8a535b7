"""Chat templates: how a chat (or a prompt/response pair) becomes text, and which of it is trained on.

A template is Jinja source rendered the way Hugging Face transformers renders a tokenizer's
`chat_template` (jinja2's ImmutableSandboxedEnvironment, trim_blocks and lstrip_blocks, the loop
controls extension, `raise_exception`, `strftime_now` and a `tojson` filter), so a template taken
from a tokenizer_config.json gives the same text here as `apply_chat_template` there. Built-in
templates (chatml, llama3, plain) are Jinja too, rendered by the same code.

Assistant spans are found by rendering prefixes, never by searching the text: the span of assistant
message i is what rendering messages[:i+1] adds to rendering messages[:i] with the generation prompt,
so a template's markers, whitespace and special tokens stay on the side they belong to. A template
for which those prefixes are not prefixes of the full render (one that rewrites earlier turns once
later ones exist) is refused with a message naming the turn.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from megatrain.storage import read_url

BUILTIN: dict[str, str] = {
    # OpenAI's ChatML, as Qwen and many fine-tunes use it.
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    # Meta Llama 3's header / end-of-turn layout.
    "llama3": (
        "{{ '<|begin_of_text|>' }}"
        "{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
        " + '<|eot_id|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    # No markers: each non-assistant turn followed by a newline, assistant turns as they are (the
    # tokenizer's end-of-document id is appended after each, see ChatTemplate.eod_after_assistant).
    "plain": (
        "{% for message in messages %}"
        "{% if message['role'] == 'assistant' %}{{ message['content'] }}"
        "{% else %}{{ message['content'] + '\n' }}{% endif %}"
        "{% endfor %}"
    ),
}
DEFAULT = "plain"


class ChatTemplateError(ValueError):
    """A template that cannot be loaded or rendered, or a chat it cannot render; says which and why."""


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    """The Jinja source."""
    name: str
    """A built-in name, or the URL it came from."""
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    """Variables such as bos_token / eos_token the template may use (from tokenizer_config.json)."""
    eod_after_assistant: bool = False
    """Append the tokenizer's end-of-document id to each assistant turn (templates without an end
    marker of their own, so the model learns to stop)."""

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False) -> str:
        try:
            return _compile(self.source).render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **self.special_tokens
            )
        except ChatTemplateError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template's own error, reported with its name
            raise ChatTemplateError(f"chat template {self.name}: {type(exc).__name__}: {exc}") from None

    def spans(self, messages: Sequence[Mapping[str, Any]]) -> list[tuple[str, bool]]:
        """The rendered chat as consecutive pieces (text, is_assistant): their concatenation is
        render(messages); assistant pieces are what each trained assistant turn adds to the text.
        An assistant message with `"weight": 0` (OpenAI's fine-tuning format) is context, not
        trained on: its text falls in the piece around it."""
        full = self.render(messages)
        pieces: list[tuple[str, bool]] = []
        done = 0  # characters of `full` already in pieces
        for i, message in enumerate(messages):
            if message.get("role") != "assistant" or message.get("weight", 1) == 0:
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[: i + 1])
            if not (upto.startswith(before) and full.startswith(upto) and len(before) >= done):
                raise ChatTemplateError(
                    f"chat template {self.name}: the render of the first {i + 1} messages is not a "
                    f"prefix of the whole chat's, so assistant turn {i} cannot be located"
                )
            if len(before) > done:
                pieces.append((full[done : len(before)], False))
            pieces.append((full[len(before) : len(upto)], True))
            done = len(upto)
        if done < len(full):
            pieces.append((full[done:], False))
        return pieces


def _raise(message: str) -> None:
    raise ChatTemplateError(f"the chat template raised: {message}")


def _compile(source: str) -> Any:
    """The template compiled as transformers compiles chat templates (a sandbox: no attribute access
    to Python internals, no mutation of the inputs)."""
    cached = _COMPILED.get(source)
    if cached is not None:
        return cached
    from jinja2 import TemplateSyntaxError, nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):
        # transformers' {% generation %} ... {% endgeneration %} marks assistant text for its own
        # masks; here the body renders as is (spans come from prefixes).
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # fmt: skip
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        compiled = env.from_string(source)
    except TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template: line {exc.lineno}: {exc.message}") from None
    _COMPILED[source] = compiled
    return compiled


_COMPILED: dict[str, Any] = {}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def from_tokenizer_config(config: Mapping[str, Any], name: str) -> ChatTemplate:
    """The `chat_template` of a parsed tokenizer_config.json (a string, or a list of named templates
    of which "default" is taken), with its special tokens as variables."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    if not isinstance(template, str) or not template.strip():
        raise ChatTemplateError(f"{name}: no chat_template string (or 'default' named template) in it")
    specials = {}
    for key, value in config.items():
        text = _token_text(value)
        if key.endswith("_token") and text is not None:
            specials[key] = text
    return ChatTemplate(template, name, specials)


def load_chat_template(spec: str | None) -> ChatTemplate:
    """data.chat_template: None (the default built-in), a built-in name, or the URL (or path) of a
    tokenizer_config.json whose Jinja `chat_template` is used."""
    spec = spec or DEFAULT
    if spec in BUILTIN:
        return ChatTemplate(BUILTIN[spec], spec, {}, eod_after_assistant=spec == "plain")
    if "/" not in spec and ":" not in spec:
        raise ChatTemplateError(
            f"data.chat_template={spec!r} is neither a built-in template ({', '.join(BUILTIN)}) nor the URL "
            "of a tokenizer_config.json"
        )
    try:
        with read_url(spec) as f:
            config = json.loads(f.read().decode("utf-8"))
    except json.JSONDecodeError as exc:
        raise ChatTemplateError(f"data.chat_template={spec}: not valid JSON ({exc.msg})") from None
    except Exception as exc:  # noqa: BLE001 - storage errors name the URL
        raise ChatTemplateError(f"data.chat_template={spec}: {exc}") from None
    if not isinstance(config, Mapping):
        raise ChatTemplateError(f"data.chat_template={spec}: not a JSON object")
    template = from_tokenizer_config(config, spec)
    _compile(template.source)  # a syntax error now, not at the first record
    return template
