"""The model server's HTTP side: OpenAI's /v1/chat/completions and /v1/completions over a Batcher
(a decoder), or /v1/embeddings over an Embedder (an encoder, arch bert); each answers the other's
routes with a 400 naming what the model is.

Each request becomes n sequences per prompt, submitted to the batcher (which runs them among every
other request's), whose tokens come back through an asyncio queue: streamed as OpenAI's SSE chunks
(ending with `data: [DONE]`; a usage chunk first when stream_options.include_usage asks), or
gathered into one answer. A client that leaves mid-stream has its sequences cancelled. A request may
name a LoRA checkpoint (`adapter`, set by the API); its adapters are read once, then kept.

GET /health says what the server holds and how its batches ran (the rows of its largest decode
step, how many steps mixed adapters), and each answer carries `x-megatrain-server` (host:pid), so a
test can tell that one process served several requests.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from megatrain.engine.data.chat_templates import ChatTemplate, ChatTemplateError, load_chat_template
from megatrain.engine.serving.adapters import Adapter, AdapterBank, AdapterError
from megatrain.engine.serving.batcher import Batcher, Busy, Delta, SamplingParams, Sequence
from megatrain.engine.serving.embeddings import MAX_INPUTS, Embedder, InputError
from megatrain.engine.serving.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    chat_logprobs,
    completion_logprobs,
    embedding_list,
    envelope,
    new_id,
    parse,
    usage,
)
from megatrain.engine.serving.text import encode_chat_prompt

SERVER_HEADER = "x-megatrain-server"


@dataclass
class ModelServer:
    """What the routes serve: a decoder (and its adapters) through one batcher, or an encoder
    through one embedder (`batcher` None)."""

    batcher: Batcher | None
    template: ChatTemplate
    name: str
    """What the server holds (the serve job's base), for /health."""
    adapters: AdapterBank | None = None
    embedder: Embedder | None = None
    inflight: int = 0
    last_request_at: float = field(default_factory=time.monotonic)
    identity: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")

    def __post_init__(self) -> None:
        if (self.batcher is None) == (self.embedder is None):
            raise ValueError("a model server holds a batcher or an embedder")

    @property
    def engine(self) -> Batcher | Embedder:
        return self.batcher if self.batcher is not None else self.embedder  # type: ignore[return-value]

    def idle_s(self, now: float) -> float:
        """Seconds since the server last had anything to do (0 while it has)."""
        if self.inflight or self.engine.busy:
            return 0.0
        return now - max(self.last_request_at, self.engine.last_busy)

    def stop(self) -> None:
        self.engine.stop()

    templates: dict[str, ChatTemplate] = field(default_factory=dict)

    def generator(self, model: str) -> Batcher:
        """The batcher, or ApiError 400 for an encoder's server."""
        if self.batcher is None:
            raise ApiError(400, f"model {model!r} is an encoder (arch bert): it answers /v1/embeddings, "
                           "not chat or text completions", "model", "unsupported_endpoint")  # fmt: skip
        return self.batcher

    def text_of(self, token: int) -> str:
        return self.generator(self.name).tokenizer.decode([token])

    async def template_for(self, name: str | None) -> ChatTemplate:
        """The chat template a request names (a built-in, or a tokenizer_config.json's URL, loaded
        once), else the server's own."""
        if name is None:
            return self.template
        if name not in self.templates:
            try:
                self.templates[name] = await anyio.to_thread.run_sync(load_chat_template, name)
            except ChatTemplateError as exc:
                raise ApiError(400, str(exc), "chat_template") from None
        return self.templates[name]


class Run:
    """One request's sequences in the batcher; their deltas arrive on an asyncio queue."""

    def __init__(self, server: ModelServer):
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Delta]] = asyncio.Queue()
        self.seqs: list[Sequence] = []
        self.prompt_tokens = 0

    def submit(
        self, prompt: list[int], params: SamplingParams, adapter: Adapter | None, param: str = "messages"
    ) -> None:
        choice = len(self.seqs)
        sink: Callable[[Delta], None] = lambda d: self.loop.call_soon_threadsafe(  # noqa: E731
            self.queue.put_nowait, (choice, d)
        )
        try:
            self.seqs.append(self.server.generator(self.server.name).submit(prompt, params, sink, adapter))
        except ValueError as exc:
            self.cancel()
            raise ApiError(400, str(exc), param) from None
        except Busy as exc:  # the SDK retries a 429 after its retry-after
            self.cancel()
            raise ApiError(429, str(exc), code="rate_limit_exceeded", kind="rate_limit_error") from None

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        left = len(self.seqs)
        while left:
            choice, delta = await self.queue.get()
            left -= delta.finish_reason is not None
            if delta.finish_reason == "error":
                self.cancel()
                raise ApiError(500, f"generation failed: {delta.error}", code="generation_failed")
            yield choice, delta

    def cancel(self) -> None:
        for seq in self.seqs:
            if seq.finish_reason is None:
                self.server.generator(self.server.name).cancel(seq)

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.seqs)


def _params(req: Any, max_tokens: int, logprobs: int | None, index: int) -> SamplingParams:
    seed = None if req.seed is None else req.seed + index  # n > 1: distinct, reproducible choices
    top_p = 1.0 if req.top_p is None else max(req.top_p, 1e-9)  # 0: the likeliest token alone
    temperature = 1.0 if req.temperature is None else req.temperature
    return SamplingParams(max_tokens, temperature, top_p, seed, req.stops(), logprobs)


async def _adapter(server: ModelServer, url: str | None) -> Adapter | None:
    if url is None:
        return None
    if server.adapters is None:
        raise ApiError(400, "this server holds no adapters", "model")
    try:
        return await anyio.to_thread.run_sync(server.adapters.read, url)
    except AdapterError as exc:
        raise ApiError(400, str(exc), "model") from None
    except (OSError, ValueError) as exc:
        raise ApiError(404, f"cannot read the adapters at {url}: {exc}", "model", "model_not_found") from None


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


async def _stream(
    run: Run, chunks: AsyncIterator[dict[str, Any]], tail: dict[str, Any] | None
) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield _sse(chunk)
        if tail is not None:
            yield _sse(tail | {"choices": [], "usage": usage(run.prompt_tokens, run.completion_tokens)})
        yield b"data: [DONE]\n\n"
    except ApiError as exc:
        yield _sse(exc.body())
        yield b"data: [DONE]\n\n"
    finally:
        run.cancel()  # a client that left: its sequences end at the next step


async def _chat(request: Request, server: ModelServer) -> Response:
    req = parse(ChatRequest, await _json(request))
    batcher = server.generator(req.model)
    tokenizer, seq_length = batcher.tokenizer, batcher.seq_length
    messages = [m.as_template_message(i) for i, m in enumerate(req.messages)]
    try:
        prompt = encode_chat_prompt(messages, await server.template_for(req.chat_template), tokenizer)
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), "messages") from None
    max_tokens = req.max_completion_tokens or req.max_tokens or max(seq_length - len(prompt), 1)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    adapter = await _adapter(server, req.adapter)
    run = Run(server)
    for i in range(req.n or 1):
        run.submit(prompt, _params(req, max_tokens, logprobs, i), adapter)
    run.prompt_tokens = len(prompt) * len(run.seqs)
    head = envelope("chat.completion.chunk", new_id("chatcmpl"), req.model)
    if req.stream:

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            for i in range(len(run.seqs)):
                first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
                yield head | {"choices": [first | {"finish_reason": None}]}
            async for i, d in run.deltas():
                if not (d.text or d.finish_reason or (logprobs is not None and d.logprobs)):
                    continue  # a token whose text is not final yet (a character's first bytes)
                lp = (
                    chat_logprobs(d.logprobs, server.text_of) if logprobs is not None and d.logprobs else None
                )
                delta = {"content": d.text} if d.text else {}
                choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": _finish(d)}
                yield head | {"choices": [choice]}

        include = bool(req.stream_options and req.stream_options.include_usage)
        return _streaming(server, _stream(run, chunks(), head if include else None))
    async for _ in run.deltas():
        pass
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": s.text, "refusal": None},
            "logprobs": chat_logprobs(s.logprobs, server.text_of) if logprobs is not None else None,
            "finish_reason": _finish(s),
        }
        for i, s in enumerate(run.seqs)
    ]
    body = head | {"object": "chat.completion", "choices": choices}
    return _answer(server, body | {"usage": usage(run.prompt_tokens, run.completion_tokens)})


async def _completion(request: Request, server: ModelServer) -> Response:
    req = parse(CompletionRequest, await _json(request))
    prompts = _prompts(req.prompt, server.generator(req.model))
    adapter = await _adapter(server, req.adapter)
    run = Run(server)
    n = req.n or 1
    for prompt in prompts:
        for j in range(n):
            run.submit(prompt, _params(req, req.max_tokens or 16, req.logprobs, j), adapter, "prompt")
    run.prompt_tokens = sum(len(p) for p in prompts) * n
    head = envelope("text_completion", new_id("cmpl"), req.model)
    lp_of = completion_logprobs if req.logprobs is not None else None
    if req.stream:

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            offsets = [0] * len(run.seqs)
            async for i, d in run.deltas():
                if not (d.text or d.finish_reason or (lp_of and d.logprobs)):
                    continue
                lp = lp_of(d.logprobs, server.text_of, offsets[i]) if lp_of and d.logprobs else None
                offsets[i] += len(d.text)
                yield head | {
                    "choices": [{"text": d.text, "index": i, "logprobs": lp, "finish_reason": _finish(d)}]
                }

        include = bool(req.stream_options and req.stream_options.include_usage)
        return _streaming(server, _stream(run, chunks(), head if include else None))
    async for _ in run.deltas():
        pass
    choices = [
        {"text": s.text, "index": i, "logprobs": lp_of(s.logprobs, server.text_of) if lp_of else None,
         "finish_reason": _finish(s)}
        for i, s in enumerate(run.seqs)
    ]  # fmt: skip
    return _answer(
        server, head | {"choices": choices, "usage": usage(run.prompt_tokens, run.completion_tokens)}
    )


async def _embeddings(request: Request, server: ModelServer) -> Response:
    req = parse(EmbeddingRequest, await _json(request))
    embedder = server.embedder
    if embedder is None:
        raise ApiError(400, f"model {req.model!r} is a decoder; embeddings need an encoder (arch bert)",
                       "model", "unsupported_endpoint")  # fmt: skip
    if req.dimensions is not None and req.dimensions != embedder.hidden_size:
        why = f"dimensions={req.dimensions}: this model's embeddings have {embedder.hidden_size} dimensions"
        raise ApiError(400, f"{why}, and it cannot shorten them", "dimensions")
    if req.adapter is not None:
        raise ApiError(400, "an encoder's server holds no adapters", "model")
    inputs = req.inputs()
    if not 0 < len(inputs) <= MAX_INPUTS:
        raise ApiError(400, f"input holds {len(inputs)} inputs: 1 to {MAX_INPUTS} a request", "input")
    if any(len(x) == 0 for x in inputs):
        raise ApiError(400, "input cannot hold an empty string or an empty list of ids", "input")
    try:
        rows = await anyio.to_thread.run_sync(embedder.rows, inputs, req.truncate)
        future = embedder.submit(rows, req.pooling, req.normalize)
    except InputError as exc:
        raise ApiError(400, str(exc), "input", exc.code) from None
    except ValueError as exc:
        raise ApiError(400, str(exc), "input") from None
    except Busy as exc:
        raise ApiError(429, str(exc), code="rate_limit_exceeded", kind="rate_limit_error") from None
    try:
        vectors = await asyncio.wrap_future(future)
    except RuntimeError as exc:
        raise ApiError(500, f"embedding failed: {exc}", code="embedding_failed") from None
    body = embedding_list(vectors, req.encoding_format, req.model, sum(len(r) for r in rows))
    return _answer(server, body)


def _prompts(prompt: Any, batcher: Batcher) -> list[list[int]]:
    """A completion's prompt(s) as ids: a string, strings, ids, or lists of ids."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise ApiError(400, "prompt is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [batcher.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]


def _finish(item: Delta | Sequence) -> str | None:
    """OpenAI's finish_reason: stop or length (a cancelled sequence's client has gone)."""
    reason = item.finish_reason
    return None if reason is None else ("length" if reason == "length" else "stop")


async def _json(request: Request) -> Any:
    try:
        return await request.json()
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not valid JSON") from None


def _answer(server: ModelServer, body: dict[str, Any]) -> JSONResponse:
    return JSONResponse(body, headers={SERVER_HEADER: server.identity})


def _streaming(server: ModelServer, body: AsyncIterator[bytes]) -> StreamingResponse:
    headers = {SERVER_HEADER: server.identity, "cache-control": "no-cache"}
    return StreamingResponse(body, media_type="text/event-stream", headers=headers)


class BearerAuth:
    """ASGI middleware: a request without `Authorization: Bearer TOKEN` is answered 401 (OpenAI's
    error shape) before any route sees it."""

    def __init__(self, app: Any, token: str):
        self.app, self.expected = app, f"Bearer {token}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = ApiError(
                    401, "this model server answers its control plane alone", code="invalid_api_key"
                )
                await JSONResponse(error.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(server: ModelServer, token: str | None = None) -> Starlette:
    """The server's routes over `server` (its batcher or embedder must be running); with a token,
    only requests that carry it (BearerAuth)."""

    def route(handler: Any) -> Any:
        async def endpoint(request: Request) -> Response:
            server.inflight += 1
            try:
                return await handler(request, server)  # type: ignore[no-any-return]
            except ApiError as exc:
                headers = {SERVER_HEADER: server.identity}
                if exc.status == 429:
                    headers["retry-after"] = "1"
                return JSONResponse(exc.body(), status_code=exc.status, headers=headers)
            finally:
                server.inflight -= 1
                server.last_request_at = time.monotonic()

        return endpoint

    async def health(_: Request) -> Response:
        head = {"status": "ok", "model": server.name, "server": server.identity}
        if server.embedder is not None:
            e = server.embedder
            return JSONResponse(
                head | {"kind": "encoder", "adapters": [], "waiting": e.queue.requests, **vars(e.stats)}
            )
        batcher = server.generator(server.name)
        stats = batcher.stats
        return JSONResponse(
            head | {"kind": "decoder",
             "adapters": sorted(server.adapters.slots) if server.adapters else [],
             "running": len(batcher.rows), "waiting": len(batcher.pending),
             "steps": stats.steps, "tokens": stats.tokens, "most_rows": stats.most_rows,
             "mixed_adapter_steps": stats.mixed_steps, "prefills": stats.prefills,
             "shared_prefills": stats.shared_prefills},
        )  # fmt: skip

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/chat/completions", route(_chat), methods=["POST"]),
        Route("/v1/completions", route(_completion), methods=["POST"]),
        Route("/v1/embeddings", route(_embeddings), methods=["POST"]),
    ]
    app = Starlette(routes=routes)
    if token is not None:
        app.add_middleware(BearerAuth, token=token)
    return app
