"""The model server's HTTP side (megatrain/engine/serving/server.py) through the `openai` package
(its own client over the ASGI app): n choices with seeds, stop strings, log-probabilities, streams
ending with a usage chunk, the legacy completions, errors as the SDK's exception classes, and the
server's bearer token asked of every request."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from starlette.testclient import TestClient

from megatrain.engine.config import TransformerConfig
from megatrain.engine.data.chat_templates import load_chat_template
from megatrain.engine.data.tokenizers import ByteTokenizer
from megatrain.engine.models.gpt import GPTModel
from megatrain.engine.serving import Batcher, encode_chat_prompt
from megatrain.engine.serving.server import ModelServer, create_app

openai = pytest.importorskip("openai")
BYTES = ByteTokenizer()
CHAT = [{"role": "user", "content": "hi"}]
TOKEN = "serve-token"


@pytest.fixture(scope="module")
def sdk() -> Iterator[tuple[Any, Batcher]]:
    torch.manual_seed(0)
    cfg = TransformerConfig.preset("tiny-llama", init_method_std=0.3, vocab_size=384, seq_length=48)
    batcher = Batcher(GPTModel(cfg).eval(), BYTES, max_batch=4).start()
    app = create_app(ModelServer(batcher, load_chat_template(None), "tiny"), token=TOKEN)
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key=TOKEN, http_client=http), batcher
    batcher.stop()


def test_chat_choices_seeds_stops_and_logprobs(sdk: tuple[Any, Batcher]) -> None:
    client, batcher = sdk
    greedy = client.chat.completions.create(model="m", messages=CHAT, temperature=0, max_tokens=10)
    ids = encode_chat_prompt(CHAT, load_chat_template(None), BYTES)
    assert greedy.usage.prompt_tokens == len(ids) and greedy.choices[0].finish_reason in ("stop", "length")
    text = greedy.choices[0].message.content
    shared = batcher.stats.shared_prefills
    sampled = [
        client.chat.completions.create(
            model="m", messages=CHAT, n=3, seed=7, max_tokens=10, logprobs=True, top_logprobs=2
        )  # fmt: skip
        for _ in range(2)
    ]
    assert batcher.stats.shared_prefills - shared == 4  # each request's 3 choices: one prefill
    assert [c.message.content for c in sampled[0].choices] == [c.message.content for c in sampled[1].choices]
    assert sampled[0].usage.completion_tokens == sum(len(c.logprobs.content) for c in sampled[0].choices)
    first = sampled[0].choices[0].logprobs.content[0]
    assert len(first.top_logprobs) == 2 and first.top_logprobs[0].logprob >= first.top_logprobs[1].logprob
    if len(text) > 3:  # a stop string ends the answer before it
        stopped = client.chat.completions.create(model="m", messages=CHAT, temperature=0, stop=[text[2:4]])
        assert stopped.choices[0].message.content == text[: text.index(text[2:4])]
        assert stopped.choices[0].finish_reason == "stop"


def test_streams_end_with_usage_and_completions_answer(sdk: tuple[Any, Batcher]) -> None:
    client, _ = sdk
    whole = client.chat.completions.create(model="m", messages=CHAT, temperature=0, max_tokens=12)
    options = {"temperature": 0, "max_tokens": 12, "stream_options": {"include_usage": True}}
    stream = client.chat.completions.create(model="m", messages=CHAT, stream=True, **options)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == whole.choices[0].message.content
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    legacy = client.completions.create(model="m", prompt=["ab", "cd"], n=2, max_tokens=5, seed=1, logprobs=1)
    assert [c.index for c in legacy.choices] == [0, 1, 2, 3] and legacy.usage.prompt_tokens == 8
    assert all(len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) for c in legacy.choices)
    streamed = list(
        client.completions.create(model="m", prompt="ab", max_tokens=5, temperature=0, stream=True)
    )
    assert streamed[-1].choices[0].finish_reason in ("stop", "length")


def test_errors_are_the_sdks_exceptions(sdk: tuple[Any, Batcher]) -> None:
    client, _ = sdk
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="m", messages=[], max_tokens=5)
    assert bad.value.param == "messages"
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(
            model="m", messages=CHAT, tools=[{"type": "function", "function": {"name": "f"}}]
        )
    with pytest.raises(openai.BadRequestError, match="reads at most"):  # longer than seq_length
        client.completions.create(model="m", prompt="x" * 60)
    with pytest.raises(openai.BadRequestError, match="adapters"):
        client.chat.completions.create(model="m", messages=CHAT, extra_body={"adapter": "file:///nowhere"})


def test_every_request_needs_the_servers_token(sdk: tuple[Any, Batcher]) -> None:
    client, _ = sdk
    for key in ("wrong", TOKEN + "x"):
        with pytest.raises(openai.AuthenticationError, match="control plane"):
            client.with_options(api_key=key).chat.completions.create(model="m", messages=CHAT, max_tokens=2)
    http = client._client  # the TestClient: /health names the adapters, so it asks for the token too
    assert http.get("http://testserver/health").status_code == 401
    auth = {"authorization": f"Bearer {TOKEN}"}
    assert http.get("http://testserver/health", headers=auth).json()["status"] == "ok"
