"""Sentence embeddings from an encoder (BERT): what /v1/embeddings computes, without the HTTP.

An input is read as [CLS] pieces [SEP] (as a Hugging Face BERT tokenizer encodes one text), rows of
unequal lengths are padded to the longest in their batch, padding a segment of its own (the encoder's
attention keeps real tokens off it, as transformers' attention mask does), and each row's final
hidden states are pooled: `mean` over its real tokens, [CLS] and [SEP] included (sentence-
transformers' mean pooling), or `cls`, the first token's state; then L2-normalised unless asked not to.

Embedder runs requests on one thread, as the Batcher runs generation: the rows of every waiting
request share batches of at most max_batch rows, in the order they came, and the thread ticks the
hang watch between batches (a wedged forward stops the ticks).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from megatrain.engine.data.tokenizers import Tokenizer
from megatrain.engine.models.bert import BertModel
from megatrain.engine.serving.batcher import Busy

POOLINGS = ("mean", "cls")
MAX_INPUTS = 2048
"""Inputs in one request (OpenAI's limit)."""
TOO_LONG = "context_length_exceeded"
"""OpenAI's code for an input longer than the model reads."""


@dataclass(frozen=True)
class Specials:
    """The pieces around and between inputs."""

    cls: int
    sep: int
    pad: int
    """Padding's id: any id the embedding holds (padding is never attended to)."""

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> Specials:
        """From an `hf` WordPiece tokenizer ([CLS], [SEP], [PAD]; [PAD] absent: id 0); ValueError
        for a tokenizer without them."""
        from megatrain.engine.data.encoder import wordpiece_vocab

        vocab = wordpiece_vocab(tokenizer)
        return cls(vocab.cls, vocab.sep, vocab.pad if vocab.pad is not None else 0)


class InputError(ValueError):
    """An input the model cannot read: its index in the request, and OpenAI's error code for why."""

    def __init__(self, index: int, message: str, code: str | None = None):
        super().__init__(message)
        self.index, self.code = index, code


def encoder_rows(
    inputs: Sequence[str | Sequence[int]],
    tokenizer: Tokenizer,
    specials: Specials,
    seq_length: int,
    truncate: bool = False,
) -> list[list[int]]:
    """Each input as [CLS] ids [SEP]: a text tokenized, a list of ids taken as the text's pieces
    (what `tokenizer.encode` gives, no specials). Longer than seq_length: cut to it, [SEP] kept,
    with `truncate`, else InputError."""
    texts = [(i, x) for i, x in enumerate(inputs) if isinstance(x, str)]
    pieces: list[Sequence[int]] = list(inputs)  # type: ignore[arg-type]
    for (i, _), ids in zip(texts, tokenizer.encode_batch([x for _, x in texts]), strict=True):
        pieces[i] = ids
    rows = []
    for i, ids in enumerate(pieces):
        if len(ids) + 2 > seq_length:
            if not truncate:
                raise InputError(
                    i,
                    f"input[{i}] is {len(ids) + 2} tokens with [CLS] and [SEP]; this model reads at most "
                    f"{seq_length} (send truncate: true to cut it there)",
                    TOO_LONG,
                )
            ids = ids[: seq_length - 2]
        rows.append([specials.cls, *ids, specials.sep])
    return rows


def pad_rows(
    rows: Sequence[Sequence[int]], pad: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B, T), real (B, T) bool): rows padded on the right to the longest."""
    longest = max(len(r) for r in rows)
    tokens = torch.full((len(rows), longest), pad, dtype=torch.long)
    real = torch.zeros((len(rows), longest), dtype=torch.bool)
    for b, row in enumerate(rows):
        tokens[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        real[b, : len(row)] = True
    return tokens.to(device), real.to(device)


def pool(hidden: torch.Tensor, real: torch.Tensor, pooling: str) -> torch.Tensor:
    """hidden (B, T, C), real (B, T) -> (B, C) in fp32: the mean over real tokens, or the first's."""
    hidden = hidden.float()
    if pooling == "cls":
        return hidden[:, 0]
    if pooling != "mean":
        raise ValueError(f"pooling {pooling!r} is not one of {', '.join(POOLINGS)}")
    weights = real.unsqueeze(-1).float()  # (B, T, 1)
    return (hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0)


@torch.inference_mode()
def embed_rows(
    model: BertModel,
    rows: Sequence[Sequence[int]],
    pad: int,
    poolings: Sequence[str],
    normalize: Sequence[bool],
) -> torch.Tensor:
    """One batch of rows (each [CLS] ... [SEP]) -> (B, C) fp32 on the CPU, row b pooled by
    poolings[b] and normalised where normalize[b]."""
    device = model.embed.weight.device
    tokens, real = pad_rows(rows, pad, device)
    # Padding is segment 1 and real tokens segment 0: attention never crosses between them (rows of
    # one length: no padding, the plain full attention).
    segments = None if bool(real.all()) else (~real).long()
    hidden = model.hidden_states(tokens, segment_ids=segments)  # (B, T, C)
    by_cls = torch.tensor([p == "cls" for p in poolings], device=device)
    out = torch.where(by_cls[:, None], pool(hidden, real, "cls"), pool(hidden, real, "mean"))
    norm = torch.tensor(list(normalize), device=device)
    return torch.where(norm[:, None], F.normalize(out, dim=-1), out).cpu()


@dataclass
class _Request:
    rows: list[list[int]]
    pooling: str
    normalize: bool
    out: torch.Tensor
    """(N, C): filled as its rows are embedded."""
    future: Future[torch.Tensor]
    left: int


@dataclass
class EmbedStats:
    requests: int = 0
    inputs: int = 0
    tokens: int = 0
    """Real tokens read ([CLS] and [SEP] included)."""
    batches: int = 0
    most_rows: int = 0


@dataclass
class _Queue:
    rows: deque[tuple[_Request, int]] = field(default_factory=deque)
    requests: int = 0
    """Requests with rows still waiting."""


class Embedder:
    """Embeddings of `model` (an encoder, eval mode, any device) in batches of up to max_batch rows;
    texts read with `tokenizer` (its [CLS], [SEP] and [PAD] unless `specials` are given)."""

    def __init__(
        self,
        model: BertModel,
        tokenizer: Tokenizer,
        *,
        specials: Specials | None = None,
        max_batch: int = 16,
        max_waiting: int | None = None,
    ):
        cfg = model.config
        if not cfg.is_encoder:
            raise ValueError("embeddings need an encoder (arch bert)")
        self.model, self.tokenizer, self.max_batch = model.eval(), tokenizer, max_batch
        self.specials = specials if specials is not None else Specials.of(tokenizer)
        self.seq_length, self.hidden_size = cfg.seq_length, cfg.hidden_size
        self.limit = min(cfg.real_vocab_size, cfg.vocab_size)
        self.max_waiting = 8 * max_batch if max_waiting is None else max_waiting
        """Requests that may wait; past it, submit raises Busy."""
        self.queue = _Queue()
        self.stats = EmbedStats()
        self.last_busy = time.monotonic()
        self.running = 0
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # -- the request side (any thread) --------------------------------------------------------

    def rows(self, inputs: Sequence[str | Sequence[int]], truncate: bool = False) -> list[list[int]]:
        """encoder_rows with this model's tokenizer, specials and length."""
        return encoder_rows(inputs, self.tokenizer, self.specials, self.seq_length, truncate)

    def submit(
        self, rows: list[list[int]], pooling: str = "mean", normalize: bool = True
    ) -> Future[torch.Tensor]:
        """Queue one request's rows (each [CLS] ... [SEP]); its future gives (N, C) fp32. ValueError
        for rows this model cannot read, Busy when too many requests wait."""
        if pooling not in POOLINGS:
            raise ValueError(f"pooling {pooling!r} is not one of {', '.join(POOLINGS)}")
        if not 0 < len(rows) <= MAX_INPUTS:
            raise ValueError(f"a request embeds 1 to {MAX_INPUTS} inputs, not {len(rows)}")
        for i, row in enumerate(rows):
            if not 0 < len(row) <= self.seq_length:
                why = f"input[{i}] is {len(row)} tokens; this model reads 1 to {self.seq_length}"
                raise InputError(i, why, TOO_LONG if row else None)
            if min(row) < 0 or max(row) >= self.limit:
                raise InputError(i, f"input[{i}]: token ids must be in [0, {self.limit})")
        future: Future[torch.Tensor] = Future()
        request = _Request(
            rows, pooling, normalize, torch.empty(len(rows), self.hidden_size), future, len(rows)
        )
        # Longest first: a request's rows fill batches with rows of like length (less padding).
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
        with self._cv:
            if self._stopping:
                raise Busy("the server is shutting down")
            if self.queue.requests >= self.max_waiting:
                raise Busy(f"{self.queue.requests} requests wait; retry shortly")
            self.queue.rows.extend((request, i) for i in order)
            self.queue.requests += 1
            self.last_busy = time.monotonic()
            self._cv.notify()
        return future

    def embed(self, rows: list[list[int]], pooling: str = "mean", normalize: bool = True) -> torch.Tensor:
        """Submit and wait (the loop must be running: `start`)."""
        return self.submit(rows, pooling, normalize).result()

    @property
    def busy(self) -> bool:
        return bool(self.queue.rows or self.running)

    # -- the model side (one thread) ----------------------------------------------------------

    def start(self, on_tick: Callable[[], None] | None = None, tick_s: float = 1.0) -> Embedder:
        """Run the loop on a daemon thread; `on_tick` is called about every tick_s from it."""
        self._thread = threading.Thread(
            target=self._loop, args=(on_tick, tick_s), daemon=True, name="embedder"
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()

    def _loop(self, on_tick: Callable[[], None] | None, tick_s: float) -> None:
        last_tick = time.monotonic()
        while True:
            with self._cv:
                if self._stopping:
                    break
                if not self.queue.rows:
                    self._cv.wait(timeout=tick_s)
            self.step()
            now = time.monotonic()
            if on_tick is not None and now - last_tick >= tick_s:
                on_tick()
                last_tick = now
        with self._cv:
            left = {id(r): r for r, _ in self.queue.rows}
            self.queue = _Queue()
        for request in left.values():
            request.future.set_exception(RuntimeError("the server is shutting down"))

    def step(self) -> None:
        """Embed the next batch of waiting rows (none: nothing)."""
        with self._cv:
            batch = [self.queue.rows.popleft() for _ in range(min(self.max_batch, len(self.queue.rows)))]
            self.running = len(batch)
        if not batch:
            return
        try:
            rows = [r.rows[i] for r, i in batch]
            out = embed_rows(self.model, rows, self.specials.pad, [r.pooling for r, _ in batch],
                             [r.normalize for r, _ in batch])  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the requests answer it; the loop goes on
            self._fail({id(r): r for r, _ in batch}, exc)
            return
        finally:
            self.running = 0
            self.last_busy = time.monotonic()
        s = self.stats
        s.batches, s.most_rows = s.batches + 1, max(s.most_rows, len(batch))
        s.tokens += sum(len(row) for row in rows)
        for (request, i), vector in zip(batch, out, strict=True):
            request.out[i] = vector
            request.left -= 1
            if request.left == 0:
                with self._cv:
                    self.queue.requests -= 1
                s.requests, s.inputs = s.requests + 1, s.inputs + len(request.rows)
                request.future.set_result(request.out)

    def _fail(self, requests: dict[int, _Request], exc: Exception) -> None:
        """The requests of a batch that failed end with its error; their other rows are dropped."""
        with self._cv:
            self.queue.rows = deque((r, i) for r, i in self.queue.rows if id(r) not in requests)
            self.queue.requests -= len(requests)
        for request in requests.values():
            request.future.set_exception(RuntimeError(f"{type(exc).__name__}: {exc}"))
