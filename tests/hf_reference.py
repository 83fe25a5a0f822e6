"""The float64 per-document reference the transformers tests compare the CP runtime with:
casts kept in float64, the summed next-token loss, and each document run alone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class KeepFloat64(TorchFunctionMode):
    """Casts of float64 tensors to float32 (``.float()``, ``.to(torch.float32)``, a
    ``dtype=torch.float32`` keyword, as norms, softmaxes and losses upcast half precision)
    stay float64, so every family computes in float64 on both sides and any difference is
    the runtime's, not float32 rounding of slightly different sums."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        double = any(isinstance(a, torch.Tensor) and a.dtype == torch.float64 for a in args)
        if double:
            if func is torch.Tensor.float:
                return args[0]
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
            if func in (torch.Tensor.to, torch.Tensor.type):
                args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        return func(*args, **kwargs)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, total: int) -> torch.Tensor:
    """Summed next-token cross-entropy over ``total`` labels, in float64 (transformers' own
    loss upcasts logits to float32 only)."""
    return torch.nn.functional.cross_entropy(logits[0].to(torch.float64), labels, ignore_index=-100,
                                             reduction="sum") / total


def per_document_reference(model: Any, ids: torch.Tensor, doc_lengths: Sequence[int]
                           ) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and every parameter's gradient of ``model`` (eager attention) run on each
    document of the packed ``ids`` alone, positions restarting at 0, in float64."""
    from worker_runtime.hf import next_token_labels

    model.set_attn_implementation("eager")
    labels = next_token_labels(ids, list(doc_lengths))
    total = int((labels != -100).sum())
    starts = [0, *torch.cumsum(torch.tensor(list(doc_lengths)), 0).tolist()]
    loss_sum = 0.0
    with KeepFloat64():
        for lo, hi in zip(starts[:-1], starts[1:], strict=True):
            logits = model(input_ids=ids[lo:hi][None], position_ids=torch.arange(hi - lo)[None]).logits
            loss = lm_loss(logits, labels[lo:hi], total)
            loss.backward()
            loss_sum += loss.item()
    return loss_sum, {n: p.grad.clone() for n, p in model.named_parameters()}


def sgd_step(model: Any, grads: dict[str, Any], lr: float) -> None:
    """``p -= lr * g`` for every parameter (``grads``: name to a tensor or array): the
    update between the steps of the two-step training tests."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p -= lr * torch.as_tensor(grads[name])


def reference_steps(model: Any, ids: torch.Tensor, doc_lengths: Sequence[int], steps: int,
                    lr: float) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """``per_document_reference`` of ``steps`` training steps, ``sgd_step`` between them."""
    out = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        out.append(per_document_reference(model, ids, doc_lengths))
        sgd_step(model, out[-1][1], lr)
    return out


def cp_train_steps(model: Any, attn: Any, ids: torch.Tensor, steps: int, lr: float
                   ) -> list[dict[str, Any]]:
    """``steps`` training steps of ``model`` (passed to ``enable_cp_attention``) on this
    rank's share of ``ids`` through the runtime ``attn``, ``sgd_step`` between them: each
    step's loss and every parameter gradient, all-reduced over the world (the gradients as
    numpy arrays: tensors would cross process boundaries as shared memory)."""
    import torch.distributed as dist

    from worker_runtime.hf import prepare_batch, use_cp_attention

    out = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        batch = prepare_batch(attn, ids)
        labels, total = batch.pop("labels")[0], batch.pop("num_items_in_batch")
        batch.pop("shift_labels")
        with KeepFloat64(), use_cp_attention(attn):
            loss = lm_loss(model(**batch).logits, labels, total)
            loss.backward()
        total_loss = loss.detach().clone()
        dist.all_reduce(total_loss)
        grads = {}
        for n, p in model.named_parameters():
            assert p.grad is not None, n
            dist.all_reduce(p.grad)
            grads[n] = p.grad.numpy().copy()
        out.append({"loss": total_loss.item(), "grads": grads})
        sgd_step(model, grads, lr)
    return out
