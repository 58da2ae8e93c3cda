"""The language-model loss without the whole micro batch's logits held (train.loss_kernel): mean
cross-entropy of `x @ weight^T` against the targets, in pieces (chunked: train.loss_chunks of them)
or fused (liger-kernel's Triton kernel, an optional extra that needs CUDA). A target of IGNORE_INDEX
adds nothing, as in F.cross_entropy: the mean is over the other targets.

The head's logits are the largest activation of a GPT-2 step (B x T x 50304: 3.1 GiB in bf16 at
32 x 1024, and the loss's fp32 softmax twice that). Computed whole, autograd keeps them from the
forward to the backward. Here the B x T positions are split into `chunks` pieces; each piece's
logits are made, turned into the piece's loss and into its gradients (softmax minus the one-hot
target, times the head's weight for the input, times the input for the weight), and dropped
before the next piece. The backward only scales the two stored gradients by the incoming one, so
no logits are recomputed: the FLOPs are those of the whole-batch head. What stays from the forward
to the backward is the input's gradient (B x T x n_embd) and the weight's (vocab x n_embd, fp32).

The weight is whatever tensor the head multiplies with at forward time: the tied embedding's
parameter (its gradient then adds to the lookup's in autograd, as for the unchunked head), or
FSDP's unsharded parameter of the root unit (its gradient arrives in the backward like any other,
before the root's reduce-scatter). Under autocast the matmuls run in the autocast dtype exactly as
the unchunked head's forward and backward do (bf16 logits, fp32 softmax; the gradients' matmuls in
bf16 with the results kept in fp32).
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from trainer.errors import ConfigError

IGNORE_INDEX = -100  # F.cross_entropy's default (and liger-kernel's): a position that is not scored
FUSED_PACKAGE = "liger_kernel"  # the `fused` extra (pyproject.toml)


def resolve_loss_kernel(kernel: str, chunks: int, device: torch.device) -> str:
    """train.loss_kernel as the run computes it: plain, chunked or fused. auto: chunked when
    train.loss_chunks > 1 (what such a config always meant), else fused on CUDA with the extra
    installed, else plain. fused elsewhere, or without the extra: ConfigError (one line)."""
    if kernel == "auto":
        if chunks > 1:
            return "chunked"
        return "fused" if device.type == "cuda" and fused_installed() else "plain"
    if kernel == "fused" and device.type != "cuda":
        raise ConfigError(f"train.loss_kernel=fused runs liger-kernel's Triton kernels, which need a CUDA device, "
                          f"not {device.type}; use train.loss_kernel=chunked (the logits in pieces) or auto")
    if kernel == "fused" and not fused_installed():
        raise ConfigError("train.loss_kernel=fused needs liger-kernel, which is not installed; "
                          "pip install 'dtrain[fused]', or use train.loss_kernel=chunked or auto")
    return kernel


def fused_installed() -> bool:
    return importlib.util.find_spec(FUSED_PACKAGE) is not None


def fused_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                        per_token: bool = False) -> torch.Tensor:
    """liger-kernel's fused linear cross-entropy: the head's matmul and the loss in chunks of rows
    inside Triton kernels, the gradients made in the forward (as chunked's). Under autocast its
    inputs are cast to the autocast dtype (the kernel itself is not autocast-aware), as the plain
    head's matmul would run. `per_token`: each position's loss (reduction none), for bits per byte."""
    # Deferred: an optional extra that imports Triton; only a run with loss_kernel=fused reaches here.
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
    x, targets = x.reshape(-1, x.size(-1)), targets.reshape(-1)
    return liger_fused_linear_cross_entropy(x, weight, targets, ignore_index=IGNORE_INDEX,
                                            reduction="none" if per_token else "mean")


def chunked_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunks: int,
                          per_token: bool = False) -> torch.Tensor:
    """Mean cross-entropy of the logits `x @ weight.T` ((..., n_embd) x (vocab, n_embd)) against
    `targets` (...), computed in `chunks` pieces of the flattened positions; `per_token` (no
    gradient: validation's bits per byte) gives each position's loss instead of the mean (0 where the
    target is IGNORE_INDEX)."""
    x, targets = x.reshape(-1, x.size(-1)), targets.reshape(-1)
    if per_token:
        return torch.cat([_piece_losses(F.linear(xs, weight).float(), ts)
                          for xs, ts in zip(x.chunk(chunks), targets.chunk(chunks))])
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _ChunkedLinearCrossEntropy.apply(x, weight, targets, chunks)
    total = sum(_piece_loss(F.linear(xs, weight).float(), ts)
                for xs, ts in zip(x.chunk(chunks), targets.chunk(chunks)))
    return total / (targets != IGNORE_INDEX).sum()


def _piece_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each row of fp32 logits against its target (0 for IGNORE_INDEX)."""
    scored = targets != IGNORE_INDEX
    picked = logits.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    return torch.where(scored, torch.logsumexp(logits, dim=-1) - picked, 0.0)


def _piece_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of fp32 logits (rows) against their targets."""
    return _piece_losses(logits, targets).sum()


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """The loss and both gradients in the forward, piece by piece; the backward scales them."""

    @staticmethod
    def forward(ctx, x, weight, targets, chunks):
        n = (targets != IGNORE_INDEX).sum()  # the scored positions the mean is over
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = torch.empty_like(x) if want_x else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if want_w else None
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        start = 0
        for xs, ts in zip(x.chunk(chunks), targets.chunk(chunks)):
            logits = F.linear(xs, weight)  # the autocast dtype under autocast, as the whole head's
            scores = logits.float()
            total = total + _piece_loss(scores, ts)
            # d(mean loss)/d(logits) = (softmax - one-hot) / n, cast back to the logits' dtype as
            # the backward of the unchunked head's .float() does
            grad = torch.softmax(scores, dim=-1)
            grad.scatter_add_(1, ts.clamp(min=0).unsqueeze(1), torch.full_like(grad[:, :1], -1.0))
            grad = (grad / n * (ts != IGNORE_INDEX).unsqueeze(1)).to(logits.dtype)  # ignored rows: none
            if want_x:
                grad_x[start : start + xs.size(0)] = grad @ weight.to(grad.dtype)
            if want_w:
                grad_w += grad.t() @ xs.to(grad.dtype)
            start += xs.size(0)
        ctx.weight_dtype = weight.dtype  # bf16 under FSDP's mixed precision: its gradient must match
        ctx.save_for_backward(grad_x, grad_w)
        return total / n

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w = ctx.saved_tensors
        return (None if grad_x is None else grad_x * grad_loss,
                None if grad_w is None else (grad_w * grad_loss).to(ctx.weight_dtype), None, None)
