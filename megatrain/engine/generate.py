"""Text generation from a single-device GPTModel with a KV cache: greedy or sampled.

    new_ids = generate(model, prompt_ids, 32)                                     # greedy
    new_ids = generate(model, prompt_ids, 32, greedy=False, temperature=0.8, top_p=0.9, seed=0)

The prompt runs in one forward (prefill), then each new token in one forward of one position over
the cache (models.gpt.KVCache). Sampling filters the logits the way transformers' logits processors
do, in their order (temperature, then top-k, then top-p), and draws from a torch.Generator, so one
seed gives one output on one device. Generation stops at eos_id, after max_new_tokens, or when the
sequence fills the model's seq_length. Logits of the padding rows beyond the real vocabulary
(vocab_limit) are never chosen.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatrain.engine.models.gpt import GPTModel, KVCache


def generate(
    model: GPTModel,
    prompt_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    *,
    greedy: bool = True,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    eos_id: int | None = None,
    vocab_limit: int | None = None,
) -> list[int]:
    """The token ids that follow `prompt_ids` (the prompt itself excluded; eos_id, when it comes,
    is the last one). greedy=False samples with temperature / top_k (0: off) / top_p (1.0: off);
    seed=None draws a fresh seed. vocab_limit (default: the config's real_vocab_size) keeps ids
    at and beyond it, the embedding's padding rows, from ever being chosen."""
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long)
    if prompt.dim() != 1:
        raise ValueError(f"prompt_ids must be one sequence of ids, got shape {tuple(prompt.shape)}")
    return generate_batch(
        model, prompt[None], max_new_tokens, greedy=greedy, temperature=temperature, top_k=top_k,
        top_p=top_p, seed=seed, eos_id=eos_id, vocab_limit=vocab_limit,
    )[0]  # fmt: skip


@torch.no_grad()
def generate_batch(
    model: GPTModel,
    prompts: torch.Tensor,
    max_new_tokens: int,
    *,
    greedy: bool = True,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    eos_id: int | None = None,
    vocab_limit: int | None = None,
) -> list[list[int]]:
    """generate() for a batch of prompts of one length, (B, T): each row's new ids, a row ending at
    its eos_id while the others go on. The model runs in eval mode (dropout off) meanwhile."""
    cfg = model.config
    limit = min(vocab_limit or cfg.real_vocab_size, cfg.vocab_size)
    device = model.embed.weight.device
    prompts = torch.as_tensor(prompts, dtype=torch.long).to(device)
    _check(prompts, max_new_tokens, limit, cfg.seq_length, greedy, temperature, top_k, top_p)
    steps = min(max_new_tokens, cfg.seq_length - prompts.shape[1])
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)

    was_training = model.training
    model.eval()
    try:
        cache = KVCache(prompts.shape[1] + steps)
        new: list[torch.Tensor] = []
        done = torch.zeros(prompts.shape[0], dtype=torch.bool, device=device)
        tokens = prompts
        for _ in range(steps):
            # Only the last position's logits are needed: the LM head on (B, C), not (B, T, C).
            hidden = model.hidden_states(tokens, kv_cache=cache)[:, -1]  # (B, C)
            # The LM head on the last position only; the padding rows' logits are dropped, so that
            # sampling sees the real vocabulary's distribution.
            logits = model.lm_head(hidden)[:, :limit].float()  # (B, limit)
            next_ids = next_tokens(logits, greedy, temperature, top_k, top_p, generator)
            new.append(next_ids)
            tokens = next_ids[:, None]
            if eos_id is not None:
                done |= next_ids == eos_id
                if bool(done.all()):  # one host sync per step
                    break
    finally:
        model.train(was_training)
    rows = torch.stack(new, dim=1).tolist() if new else [[] for _ in range(prompts.shape[0])]
    return [row[: row.index(eos_id) + 1] if eos_id in row else row for row in rows]


def next_tokens(
    logits: torch.Tensor,
    greedy: bool,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator,
) -> torch.Tensor:
    """(B,) the next token of each row from its logits (B, V) fp32: the argmax, or a draw from the
    filtered distribution (filter_logits) with `generator`."""
    if greedy:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, temperature, top_k, top_p).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def filter_logits(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """logits (B, V) fp32 -> the same with the tokens sampling may not pick set to -inf, as
    transformers' TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper (one token kept at
    least) compute them, in that order."""
    if temperature != 1.0:
        logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop the least likely tokens whose total stays within 1 - top_p; the likeliest always stays.
        drop_sorted = cumulative <= 1 - top_p
        drop_sorted[..., -1:] = False
        drop = drop_sorted.scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _check(
    prompts: torch.Tensor,
    max_new_tokens: int,
    vocab_limit: int,
    seq_length: int,
    greedy: bool,
    temperature: float,
    top_k: int,
    top_p: float,
) -> None:
    if prompts.dim() != 2 or prompts.shape[1] == 0:
        raise ValueError(
            f"prompts must be (batch, tokens) with at least one token, got {tuple(prompts.shape)}"
        )
    if prompts.shape[1] > seq_length:
        raise ValueError(f"the prompt has {prompts.shape[1]} tokens; the model's seq_length is {seq_length}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    low, high = int(prompts.min()), int(prompts.max())
    if low < 0 or high >= vocab_limit:
        bad = low if low < 0 else high
        raise ValueError(f"prompt id {bad} is outside the vocabulary [0, {vocab_limit})")
    if greedy and (temperature != 1.0 or top_k != 0 or top_p != 1.0):
        raise ValueError("greedy decoding takes no temperature, top_k or top_p: pass greedy=False to sample")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if top_k < 0:
        raise ValueError(f"top_k={top_k} must be >= 0 (0: off)")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
