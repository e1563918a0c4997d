"""chunked_cross_entropy: next-token cross-entropy from hidden states, without full logits.

The plain loss builds ``[batch, seq, vocab]`` logits, a float32 copy, the log-softmax and, in
backward, a gradient of the same size: at vocab 128k and 2048 tokens each is 1 GiB. Here:

1. the model returns its final hidden states (``model.hidden_states``);
2. positions whose label is ignored (-100: prompts, padding) are dropped first;
3. the remaining rows are projected to the vocabulary ``chunk_size`` rows at a time, and each
   chunk's loss *and* its gradients w.r.t. the hidden rows and the head weight are computed
   right there, in the forward pass, so the chunk's logits are freed before the next chunk.

Backward only scales the stored gradients by the incoming gradient, so the matmuls are the
same three as the plain loss (logits, grad-hidden, grad-weight) and nothing is recomputed:
lower memory and no slower. Gemma-style final-logit soft-capping (``model.logit_softcap``) is
applied per chunk, with its derivative folded into the chunk's gradient.

The output head may be a plain ``nn.Linear`` (also tied to the embedding) or an adapted layer
(``AdaptedLinear``, without dropout): its weight as one differentiable tensor (LoRA's
``W + s * B @ A``, ``posttune.plugin.head_weight``) is formed once per step,
so gradients reach the adapters through autograd. A head sharded as a DTensor (tensor parallel over the vocabulary,
FSDP2) is refused with one line: a vocabulary-sharded head wants a plan that parallelises the loss.
"""

from __future__ import annotations

from typing import Any

import torch

from posttune.plugin import (IGNORE_INDEX, AdaptedLinear, LossKernel, PosttuneError, head_weight, in_label_shape,
                             is_dtensor)


def apply(session: Any, target: Any) -> None:
    model = target.model
    head = getattr(model, "output", None)
    if head is None or not callable(getattr(model, "hidden_states", None)):
        raise PosttuneError("memory: chunked_cross_entropy needs a model with `hidden_states()` and an `output` "
                            f"head (the native decoder contract); {type(model).__name__} has not")
    check_head(head)
    chunk_size = session.plan.memory_options["chunked_cross_entropy"].chunk_size
    session.loss_kernel = LossKernel(
        cross_entropy=lambda model, batch: token_loss(model, batch, chunk_size=chunk_size),
        logps=lambda model, batch, temperature=1.0: token_logps(model, batch, chunk_size=chunk_size,
                                                                temperature=temperature),
        name="chunked_cross_entropy",
        logps_entropies=lambda model, batch, temperature=1.0: token_logps(
            model, batch, chunk_size=chunk_size, temperature=temperature, entropies=True),
    )


def check_head(head: torch.nn.Module) -> None:
    weight = head.weight
    if is_dtensor(weight):
        raise PosttuneError("memory: chunked_cross_entropy cannot use an output head sharded as a DTensor "
                            "(tensor parallel or FSDP2); for a vocabulary-sharded head, use a plan that parallelises "
                            "the loss instead")
    if isinstance(head, AdaptedLinear) and head.dropout_p > 0:
        raise PosttuneError("memory: chunked_cross_entropy folds the output head's adapter into one weight, "
                            f"which dropout ({head.dropout_p}) does not allow; set adapter.dropout to 0 or "
                            "leave the head (lm_head, natively `output`) out of adapter.targets")


def token_loss(model: Any, batch: dict[str, torch.Tensor], *, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``posttune.losses.token_cross_entropy``'s contract: (summed loss, labelled tokens)."""
    keep, rows = labelled_rows(model, batch)
    return linear_cross_entropy(*rows, chunk_size=chunk_size), keep.sum()


def token_logps(model: Any, batch: dict[str, torch.Tensor], *, chunk_size: int,
                temperature: float = 1.0, entropies: bool = False) -> Any:
    """``posttune.losses.token_logps``'s contract: ``[batch, seq]`` label log-probs, 0 where ignored (with
    ``entropies``, and the entropy at each labelled position, from the same chunks' logits)."""
    keep, rows = labelled_rows(model, batch)
    entropy = torch.empty(keep.sum(), dtype=torch.float32, device=keep.device) if entropies else None
    logps = linear_logps(*rows, chunk_size=chunk_size, temperature=temperature, entropy_out=entropy)
    placed = [in_label_shape(v, batch["labels"], keep) for v in (logps, entropy) if v is not None]
    return tuple(placed) if entropies else placed[0]


def labelled_rows(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, tuple[Any, ...]]:
    """(mask of labelled positions, the kernels' arguments for them: hidden rows, head weight,
    targets, bias, soft-cap). Ignored positions (prompts, padding) are dropped before the head."""
    hidden = model.hidden_states(batch["input_ids"], document_ids=batch.get("document_ids"),
                                 positions=batch.get("positions"))
    labels = batch["labels"]
    keep = labels != IGNORE_INDEX
    weight, bias = head_weight(model.output)
    return keep, (hidden[keep], weight, labels[keep], bias, getattr(model, "logit_softcap", None))


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         bias: torch.Tensor | None = None, softcap: float | None = None, *,
                         chunk_size: int = 1024) -> torch.Tensor:
    """``sum(cross_entropy(softcap(hidden @ weight.T + bias), targets))`` over rows ``[n, hidden]``.

    Every row counts (drop ignored rows first). Peak extra memory is one chunk's
    ``[chunk_size, vocab]`` float32 logits plus a float32 ``[vocab, hidden]`` weight gradient.
    """
    return _LinearCrossEntropy.apply(hidden, weight, bias, targets, softcap, chunk_size)


def linear_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                 bias: torch.Tensor | None = None, softcap: float | None = None, *,
                 chunk_size: int = 1024, temperature: float = 1.0,
                 entropy_out: torch.Tensor | None = None) -> torch.Tensor:
    """``log_softmax(softcap(hidden @ weight.T + bias) / temperature)[i, targets[i]]``: ``[n]`` float32.

    Unlike the summed loss, the gradient of each row is known only in backward (a DPO or GRPO
    loss weighs rows differently), so backward recomputes each chunk's logits: one extra
    matmul per chunk instead of keeping ``[n, vocab]`` logits alive between the passes.
    ``entropy_out`` (``[n]`` float32), when given, receives each row's entropy of the same softmax
    (no gradient flows through it).
    """
    return _LinearLogps.apply(hidden, weight, bias, targets, softcap, chunk_size, temperature, entropy_out)


def _chunk_logits(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A chunk's float32 logits (soft-capped) and, with a cap, ``tanh`` of the uncapped ones."""
    logits = (rows @ weight.T if bias is None else torch.addmm(bias, rows, weight.T)).float()
    if softcap is None:
        return logits, None
    capped = torch.tanh(logits / softcap)
    return capped * softcap, capped


class _LinearLogps(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, softcap: float | None, chunk_size: int, temperature: float,
                entropy_out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            logits, _ = _chunk_logits(hidden[start:start + chunk_size], weight, bias, softcap)
            logits = logits / temperature
            target = targets[start:start + chunk_size]
            norm = logits.logsumexp(-1)
            out[start:start + chunk_size] = logits.gather(1, target.unsqueeze(1)).squeeze(1) - norm
            if entropy_out is not None:  # H = logsumexp - sum(p * logits)
                entropy_out[start:start + chunk_size] = norm - ((logits - norm[:, None]).exp() * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.softcap, ctx.chunk_size, ctx.temperature = softcap, chunk_size, temperature
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None
        size = ctx.chunk_size
        for start in range(0, hidden.shape[0], size):
            rows = hidden[start:start + size]
            target = targets[start:start + size]
            logits, capped = _chunk_logits(rows, weight, bias, ctx.softcap)
            # d(logp_i)/d(logits_i) = (onehot - softmax(logits / T)) / T, times row i's incoming gradient
            grad = (logits / ctx.temperature).softmax(-1).neg_()
            grad[torch.arange(len(target), device=grad.device), target] += 1.0
            grad.mul_(grad_out[start:start + size].float().unsqueeze(1) / ctx.temperature)
            if capped is not None:
                grad.mul_(1.0 - capped.square())
            if need_bias:
                grad_bias += grad.sum(0)
            grad = grad.to(weight.dtype)
            if need_hidden:
                torch.matmul(grad, weight, out=grad_hidden[start:start + size])
            if need_weight:
                grad_weight += (grad.T @ rows).float()  # low precision as the plain backward, summed in fp32
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None, None)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, softcap: float | None, chunk_size: int) -> torch.Tensor:
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None
        for start in range(0, hidden.shape[0], chunk_size):
            rows = hidden[start:start + chunk_size]
            target = targets[start:start + chunk_size]
            logits = (rows @ weight.T if bias is None else torch.addmm(bias, rows, weight.T)).float()
            if softcap is not None:
                capped = torch.tanh(logits / softcap)
                logits = capped * softcap
            lse = torch.logsumexp(logits, dim=-1)
            loss += (lse - logits.gather(1, target.unsqueeze(1)).squeeze(1)).sum()
            # d(loss)/d(logits) = softmax - onehot, written into the logits' own storage.
            grad = logits.sub_(lse.unsqueeze(1)).exp_()
            grad[torch.arange(len(target), device=grad.device), target] -= 1.0
            if softcap is not None:
                grad.mul_(1.0 - capped.square())  # d(c * tanh(z / c)) / dz
            if need_bias:
                grad_bias += grad.sum(0)
            grad = grad.to(weight.dtype)
            if need_hidden:
                torch.matmul(grad, weight, out=grad_hidden[start:start + chunk_size])
            if need_weight:
                if weight.dtype == torch.float32:
                    grad_weight.addmm_(grad.T, rows)
                else:  # low-precision matmul as the plain loss's backward, summed over chunks in fp32
                    grad_weight += grad.T @ rows
        # Kept on ctx, not saved for backward: they are this function's own results, and backward
        # scales them in place (retain_graph would need a second copy; it is refused instead).
        ctx.grads = [grad_hidden, grad_weight, grad_bias]
        ctx.dtypes = [hidden.dtype, weight.dtype, None if bias is None else bias.dtype]
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.grads is None:
            raise PosttuneError("chunked_cross_entropy: backward ran twice through one loss (retain_graph); "
                                "compute the loss again instead")
        grads, ctx.grads = ctx.grads, None
        unit = bool(grad_loss == 1.0)  # the usual case: no scaling, no copy
        out = []
        for grad, dtype in zip(grads, ctx.dtypes):
            if grad is not None:
                if not unit:
                    grad.mul_(grad_loss.to(grad.dtype))
                grad = grad.to(dtype)
            out.append(grad)
        return (*out, None, None, None)
