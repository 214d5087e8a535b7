"""Continuous batching: requests join and leave the running batch between decode steps.

One thread runs the model. Each pass of its loop (`step`) first admits waiting sequences while the
batch has room: each new prompt is prefilled on its own into a free slot of the SlotCache and its
first token drawn; then one decode step runs every sequence in the batch, each row at its own
position and with its own adapter (AdapterBank), and draws each row's next token with that row's
own settings and generator. A sequence that ends (end-of-document, a stop string, max_tokens, the
model's seq_length, a cancel) leaves at once; its slot goes to the next waiting one.

Drawing follows generate(): greedy is the argmax over the real vocabulary; sampling filters the
logits (temperature, then top_p) and draws from a torch.Generator seeded per sequence, so a seeded
request alone draws exactly what generate(seed=...) draws, and a request batched with others draws
what it would alone. Each token goes to the sequence's sink as a Delta as soon as it is drawn.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatrain.engine.data.tokenizers import Tokenizer
from megatrain.engine.generate import filter_logits
from megatrain.engine.models.gpt import GPTModel
from megatrain.engine.serving.adapters import Adapter, AdapterBank
from megatrain.engine.serving.cache import SlotCache
from megatrain.engine.serving.text import TextStream

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    """0: greedy."""
    top_p: float = 1.0
    seed: int | None = None
    """None: a fresh seed."""
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    """None: no log-probabilities; k: each token's, and the k likeliest tokens' at its position."""

    def problem(self) -> str | None:
        if self.max_tokens < 1:
            return f"max_tokens={self.max_tokens} must be at least 1"
        if not 0.0 <= self.temperature <= 100.0:
            return f"temperature={self.temperature} must be in [0, 100]"
        if not 0.0 < self.top_p <= 1.0:
            return f"top_p={self.top_p} must be in (0, 1]"
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            return f"logprobs={self.logprobs} must be in [0, {MAX_TOP_LOGPROBS}]"
        return None


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Delta:
    """What one step adds to a sequence: its final text so far, the token, and why it ended."""

    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None
    """None while it runs; stop (end-of-document or a stop string), length, cancelled or error."""
    error: str | None = None


class Busy(Exception):
    """The batch is full and `max_waiting` sequences already wait: come back later (a 429)."""


class Sequence:
    """One sequence being generated: a prompt, its settings, its state in the batch."""

    def __init__(
        self,
        prompt: list[int],
        params: SamplingParams,
        stream: TextStream,
        sink: Callable[[Delta], None] | None,
        adapter: Adapter | None,
    ):
        self.prompt, self.params, self.stream, self.adapter = prompt, params, stream, adapter
        self.sink = sink
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.done = threading.Event()
        self.cancelled = False
        self.slot = 0
        """The adapter slot (0: the base alone)."""
        self.cached = 0
        """Positions of this sequence in its cache slot."""
        self.prompt_hidden: torch.Tensor | None = None
        """The prompt's last hidden state (1, C): a later sequence with this prompt and adapter (one
        of a request's `n`) copies this one's cached prompt instead of prefilling it again."""
        self.generator: torch.Generator | None = None

    def emit(self, delta: Delta) -> None:
        self.text += delta.text
        self.logprobs += delta.logprobs
        if delta.finish_reason is not None:
            self.finish_reason, self.error = delta.finish_reason, delta.error
        if self.sink is not None:
            self.sink(delta)
        if delta.finish_reason is not None:
            self.done.set()


@dataclass
class Stats:
    steps: int = 0
    """Decode steps run."""
    tokens: int = 0
    most_rows: int = 0
    """The largest batch a decode step ran."""
    mixed_steps: int = 0
    """Decode steps whose rows used two or more different adapters (the base alone counts as one)."""
    adapters_seen: set[int] = field(default_factory=set)
    prefills: int = 0
    """Prompts run through the model."""
    shared_prefills: int = 0
    """Prompts copied from a running sequence's cache slot instead (the same prompt and adapter)."""


class Batcher:
    """Continuous batching of `model` (eval mode, any device) for up to `max_batch` sequences."""

    def __init__(
        self,
        model: GPTModel,
        tokenizer: Tokenizer,
        *,
        max_batch: int = 16,
        adapters: AdapterBank | None = None,
        eos_id: int | None = None,
        max_waiting: int | None = None,
    ):
        cfg = model.config
        self.model, self.tokenizer, self.adapters = model.eval(), tokenizer, adapters
        self.eos_id = tokenizer.eod if eos_id is None else eos_id
        self.limit = min(
            cfg.real_vocab_size, cfg.vocab_size, getattr(tokenizer, "vocab_size", cfg.vocab_size)
        )
        self.device = model.embed.weight.device
        self.max_batch, self.seq_length = max_batch, cfg.seq_length
        self.max_waiting = 8 * max_batch if max_waiting is None else max_waiting
        """Sequences that may wait for a row; past it, submit raises Busy."""
        self.cache = SlotCache(max_batch, cfg.seq_length)
        self.pending: deque[Sequence] = deque()
        self.rows: list[Sequence] = []
        """The running batch: row i holds cache slot i."""
        self.stats = Stats()
        self.last_busy = time.monotonic()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # -- the request side (any thread) --------------------------------------------------------

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        sink: Callable[[Delta], None] | None = None,
        adapter: Adapter | None = None,
    ) -> Sequence:
        """Queue a sequence; ValueError for one this model cannot run, Busy when too many wait."""
        problem = params.problem()
        if problem:
            raise ValueError(problem)
        if not prompt:
            raise ValueError("the prompt is empty after tokenization")
        if len(prompt) >= self.seq_length:
            raise ValueError(
                f"the prompt is {len(prompt)} tokens; this model reads at most {self.seq_length - 1}"
            )
        if min(prompt) < 0 or max(prompt) >= self.limit:
            raise ValueError(f"prompt ids must be in [0, {self.limit})")
        if adapter is not None and self.adapters is None:
            raise ValueError("this server has no adapters")
        seq = Sequence(list(prompt), params, TextStream(self.tokenizer, params.stop), sink, adapter)
        with self._cv:
            if len(self.pending) >= self.max_waiting:
                raise Busy(f"{len(self.rows)} sequences run and {len(self.pending)} wait; retry shortly")
            self.pending.append(seq)
            self.last_busy = time.monotonic()
            self._cv.notify()
        return seq

    def cancel(self, seq: Sequence) -> None:
        """End `seq` at the next step (a client that went away)."""
        seq.cancelled = True

    def generate(self, prompt: list[int], params: SamplingParams, adapter: Adapter | None = None) -> Sequence:
        """Submit and wait for the end (the loop must be running: `start`)."""
        seq = self.submit(prompt, params, adapter=adapter)
        seq.done.wait()
        return seq

    # -- the model side (one thread) ----------------------------------------------------------

    def start(self, on_tick: Callable[[], None] | None = None, tick_s: float = 1.0) -> Batcher:
        """Run the loop on a daemon thread; `on_tick` is called about every tick_s from it."""
        self._thread = threading.Thread(
            target=self._loop, args=(on_tick, tick_s), daemon=True, name="batcher"
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.pending)

    def _loop(self, on_tick: Callable[[], None] | None, tick_s: float) -> None:
        last_tick = time.monotonic()
        while True:
            with self._cv:
                if self._stopping:
                    break
                if not self.busy:
                    self._cv.wait(timeout=tick_s)
            self.step()
            now = time.monotonic()
            if on_tick is not None and now - last_tick >= tick_s:
                on_tick()
                last_tick = now
        for seq in [*self.rows, *self.pending]:
            seq.emit(Delta("", [], [], "cancelled", "the server is shutting down"))

    def step(self) -> bool:
        """Admit what fits, then one decode step of the batch; False when there was nothing to do."""
        with torch.inference_mode():
            admitted = self._admit()
            decoded = self._decode()
        if admitted or decoded:
            self.last_busy = time.monotonic()
        return admitted or decoded

    def _admit(self) -> bool:
        admitted = False
        while len(self.rows) < self.max_batch:
            with self._cv:
                if not self.pending:
                    break
                seq = self.pending.popleft()
            if seq.cancelled:
                seq.emit(Delta("", [], [], "cancelled"))
                continue
            admitted = True
            try:
                self._prefill(seq)
            except Exception as exc:  # noqa: BLE001 - this sequence fails; the batch runs on
                seq.emit(Delta("", [], [], "error", f"{type(exc).__name__}: {exc}"))
                continue
            if seq.finish_reason is None:
                self.rows.append(seq)
        return admitted

    def _prefill(self, seq: Sequence) -> None:
        seq.generator = torch.Generator(device=self.device)
        if seq.params.seed is None:
            seq.generator.seed()
        else:
            seq.generator.manual_seed(seq.params.seed)
        if seq.adapter is not None and self.adapters is not None:
            seq.slot = self.adapters.install(seq.adapter)
        donor = next((r for r in self.rows if r.slot == seq.slot and r.prompt == seq.prompt), None)
        if donor is not None and donor.prompt_hidden is not None:
            # Its slot's first len(prompt) positions are this prompt's keys and values, computed as a
            # prefill here would compute them.
            self.cache.move(self.rows.index(donor), len(self.rows), len(seq.prompt))
            hidden = donor.prompt_hidden
            self.stats.shared_prefills += 1
        else:
            self.cache.prefill(len(self.rows))
            tokens = torch.tensor([seq.prompt], device=self.device)
            with self._adapters([seq.slot]):
                hidden = self.model.hidden_states(tokens, kv_cache=self.cache)[:, -1]  # (1, C)
            self.stats.prefills += 1
        seq.prompt_hidden = hidden
        seq.cached = len(seq.prompt)
        self._draw([seq], self.model.lm_head(hidden)[:, : self.limit].float())

    def _decode(self) -> bool:
        for i in reversed(range(len(self.rows))):  # ended by a cancel since the last step
            if self.rows[i].cancelled:
                self.rows[i].emit(Delta(self.rows[i].stream.rest(), [], [], "cancelled"))
                self._leave(i)
        if not self.rows:
            return False
        rows = self.rows
        tokens = torch.tensor([[s.tokens[-1]] for s in rows], device=self.device)  # (B, 1)
        positions = [s.cached for s in rows]
        self.cache.decode(positions, self.device)
        slots = [s.slot for s in rows]
        try:
            pos = torch.tensor(positions, device=self.device)[:, None]  # (B, 1)
            with self._adapters(slots):
                hidden = self.model.hidden_states(tokens, position_ids=pos, kv_cache=self.cache)[
                    :, -1
                ]  # (B, C)
            logits = self.model.lm_head(hidden)[:, : self.limit].float()  # (B, limit)
        except Exception as exc:  # noqa: BLE001 - the batch fails, the server stays up
            for i in reversed(range(len(rows))):
                rows[i].emit(Delta(rows[i].stream.rest(), [], [], "error", f"{type(exc).__name__}: {exc}"))
                self._leave(i)
            return True
        for s in rows:
            s.cached += 1
        self.stats.steps += 1
        self.stats.most_rows = max(self.stats.most_rows, len(rows))
        self.stats.mixed_steps += len(set(slots)) > 1
        self.stats.adapters_seen |= set(slots)
        self._draw(list(rows), logits)
        return True

    def _adapters(self, slots: list[int]) -> contextlib.AbstractContextManager[None]:
        if self.adapters is None:
            return contextlib.nullcontext()
        return self.adapters.selected(slots, self.device)

    def _draw(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Each sequence's next token from its row of logits (B, limit); ended ones leave."""
        greedy = logits.argmax(dim=-1).tolist()  # one host sync for every greedy row
        logps = (
            torch.log_softmax(logits, dim=-1) if any(s.params.logprobs is not None for s in seqs) else None
        )
        ended = []
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.temperature == 0:
                token = greedy[i]
            else:
                probs = filter_logits(logits[i : i + 1], p.temperature, 0, p.top_p).softmax(dim=-1)
                token = int(torch.multinomial(probs, 1, generator=seq.generator))
            seq.tokens.append(token)
            self.stats.tokens += 1
            lp = [] if logps is None or p.logprobs is None else [_logprob(logps[i], token, p.logprobs)]
            finish, text = None, ""
            if token == self.eos_id:
                finish = "stop"
            else:
                text, stopped = seq.stream.push(token)
                finish = "stop" if stopped else None
            if finish is None and (
                len(seq.tokens) >= p.max_tokens or len(seq.prompt) + len(seq.tokens) >= self.seq_length
            ):
                finish = "length"
            if finish is not None:
                text += seq.stream.rest()  # what was held back (nothing after a stop string)
            seq.emit(Delta(text, [token], lp, finish))
            if finish is not None:
                ended.append(seq)
        for seq in ended:
            if seq in self.rows:
                self._leave(self.rows.index(seq))

    def _leave(self, i: int) -> None:
        """Row i leaves; the last row moves into its slot so the batch stays contiguous."""
        last = self.rows.pop()
        if i < len(self.rows):
            self.cache.move(len(self.rows), i, last.cached)
            self.rows[i] = last


def _logprob(logps: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """A token's log-probability under the model (before temperature and top_p, as OpenAI's are) and
    the `top` likeliest tokens'."""
    best = torch.topk(logps, top) if top else None
    pairs = tuple(zip(best.indices.tolist(), best.values.tolist(), strict=True)) if best is not None else ()
    return TokenLogprob(token, float(logps[token]), pairs)
