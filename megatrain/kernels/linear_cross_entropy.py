"""LM head and cross-entropy in one pass over token chunks, never holding the full logits.

`linear_cross_entropy(hidden, weight, labels)` equals `F.cross_entropy((hidden @ weight.T).float(),
labels)` (the mean over tokens, or over the tokens a 0/1 `loss_mask` keeps) but, chunk by chunk of
tokens, computes the logits, their log-sum-exp and, when gradients are wanted, the logits' gradient
softmax - onehot in place of the logits, which it folds straight into the hidden states' and the
weight's gradients. The unfused path keeps fp32 (tokens × vocab) log-probabilities for backward and
allocates two more such tensors in it, the step's memory peak for large vocabularies; here the peak
is one (chunk × vocab) fp32 block, and the elementwise passes over the logits drop from about six
to three.

Gradients are computed in the forward pass (the loss is the graph's end, so its incoming gradient
is a scalar that backward applies by scaling). Under torch.no_grad (evaluation) only the loss is
computed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatrain.kernels.grad_accumulation import add_to_main_grad, fusable
from megatrain.kernels.policy import linear_cross_entropy_chunk_rows


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_tokens: int | None,
        loss_mask: torch.Tensor | None,
        vocab_limit: int | None,
    ) -> torch.Tensor:
        param = weight  # the Parameter itself: its main_grad takes the fused weight gradient
        # Rows from vocab_limit on are padding: out of the softmax, zero gradient (the Parameter is
        # still what the gradient goes to, so fusion into main_grad keeps working).
        weight = weight[:vocab_limit] if vocab_limit is not None and vocab_limit < weight.shape[0] else weight
        n, vocab = hidden.shape[0], weight.shape[0]
        want_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        rows = linear_cross_entropy_chunk_rows(n, vocab, chunk_tokens)
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = grad_param = None
        if ctx.needs_input_grad[1]:
            grad_param = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            grad_param[vocab:].zero_()
            grad_weight = grad_param[:vocab]  # rows first: a contiguous view
        # fp32: every chunk's logits land in one block (fewer fresh pages than a block per chunk);
        # 16-bit: each chunk's fp32 cast is its own block, freed before the next.
        block = None
        if weight.dtype == torch.float32:
            block = torch.empty(min(rows, n), vocab, dtype=torch.float32, device=hidden.device)
        inv_n = 1.0 / n
        # With a mask, row i's loss and gradient are weighted by mask_i / Σ mask (a tensor: no host
        # sync); 0 throughout when no token counts.
        weights = None
        if loss_mask is not None:
            mask = loss_mask.float()
            weights = (mask / mask.sum().clamp_min(1.0)).unsqueeze(1)  # (n, 1)
        for start in range(0, n, rows):
            h = hidden[start : start + rows]
            y = labels[start : start + rows]
            w = weights[start : start + rows] if weights is not None else None
            if block is not None:
                logits = torch.mm(h, weight.t(), out=block[: h.shape[0]])  # (rows, V)
            else:
                logits = (h @ weight.t()).float()
            target = logits.gather(1, y.unsqueeze(1))
            # The log-sum-exp by hand, in the logits' own storage (torch.logsumexp would allocate
            # a second (rows, V) block): logits become exp(logits - max), then the softmax.
            top = logits.amax(dim=1, keepdim=True)
            logits.sub_(top).exp_()
            total = logits.sum(dim=1, keepdim=True)
            if w is None:
                loss_sum += (total.log() + top - target).sum()
            else:
                loss_sum += ((total.log() + top - target) * w).sum()
            if not want_grad:
                del logits
                continue
            # d(mean CE)/d logits = (softmax - onehot) / n, or · mask_i / Σ mask per row.
            if w is None:
                logits.mul_(total.reciprocal_().mul_(inv_n))
                logits.scatter_add_(1, y.unsqueeze(1), torch.full_like(target, -inv_n))
            else:
                logits.mul_(total.reciprocal_().mul_(w))
                logits.scatter_add_(1, y.unsqueeze(1), -w)
            g = logits.to(hidden.dtype)
            if grad_hidden is not None:
                torch.mm(g, weight, out=grad_hidden[start : start + rows])
            if grad_weight is not None:
                if g.dtype != torch.float32:  # 16-bit GEMM, accumulated over chunks in fp32
                    part = g.t() @ h
                    if start == 0:
                        grad_weight.copy_(part)
                    else:
                        grad_weight.add_(part)
                    del part
                elif start == 0:  # the first chunk writes: no zero-fill of the (V, h) gradient
                    torch.mm(g.t(), h, out=grad_weight)
                else:
                    grad_weight.addmm_(g.t(), h)
            del logits, g  # before the next chunk's logits: one 16-bit block alive, not two
        ctx.save_for_backward(grad_hidden, grad_param)
        ctx.weight_dtype = weight.dtype
        # Under DataParallel the weight gradient is added straight into main_grad in backward.
        ctx.weight = param if grad_param is not None and fusable(param) else None
        return loss_sum * inv_n if weights is None else loss_sum

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_loss: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None, None]:
        # Scaled in place: the gradients were made for this one backward (no retain_graph reuse).
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden.mul_(grad_loss.to(grad_hidden.dtype))
        if grad_weight is not None:
            if ctx.weight is not None:
                grad_weight = add_to_main_grad(ctx.weight, grad_weight, grad_loss)
            else:
                grad_weight = grad_weight.mul_(grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _flat_mask(loss_mask: torch.Tensor | None, n: int) -> torch.Tensor | None:
    if loss_mask is None:
        return None
    mask = loss_mask.reshape(-1)
    if mask.shape[0] != n:
        raise ValueError(f"{n} labels but a loss mask of {mask.shape[0]}")
    return mask


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int | None = None,
    loss_mask: torch.Tensor | None = None,
    vocab_limit: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of (hidden @ weight.T) against labels over the tokens loss_mask (0/1)
    keeps (all without one; 0 when none is kept); hidden (..., h), labels and loss_mask (...).
    Only the first vocab_limit rows of weight are classes (the rest is padding: zero gradient)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    if h.shape[0] != y.shape[0]:
        raise ValueError(f"{h.shape[0]} hidden rows but {y.shape[0]} labels")
    mask = _flat_mask(loss_mask, y.shape[0])
    return _LinearCrossEntropy.apply(h, weight, y, chunk_tokens, mask, vocab_limit)


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int | None = None,
    loss_mask: torch.Tensor | None = None,
    vocab_limit: int | None = None,
) -> torch.Tensor:
    """The unfused twin: full fp32 logits, then torch's cross-entropy (`chunk_tokens` is ignored)."""
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight[:vocab_limit].t()
    mask = _flat_mask(loss_mask, logits.shape[0])
    if mask is None:
        return F.cross_entropy(logits.float(), labels.reshape(-1))
    per_token = F.cross_entropy(logits.float(), labels.reshape(-1), reduction="none")
    return (per_token * mask.float()).sum() / mask.float().sum().clamp_min(1.0)
