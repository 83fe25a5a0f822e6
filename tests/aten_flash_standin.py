"""A CPU stand-in for PyTorch's FlashAttention ops with their exact contract.

``forward`` / ``backward`` take the arguments of ``torch.ops.aten._flash_attention_forward``
/ ``_flash_attention_backward`` (same names, order, keyword-only part; a test compares them
with the ops' schemas) and return the same tuples: ``(output, logsumexp [H, T] float32,
rng_state, unused, debug_attn_mask)`` and ``(dq, dk, dv)``. Semantics as the CUDA kernels:
bottom-right causal alignment per segment, ``window_size_left/right`` around the aligned
query position, natural-log LSE, a query that sees no key gives
out 0 and LSE +inf, GQA with query head h on KV head h // (H / G) and dK/dV summed over
each group, keys of a segment without queries get dK = dV = 0. Dense per segment in
float64 (any input dtype; outputs in the input dtype, LSE float32).

``variant`` builds stand-ins that differ on purpose (the probe must refuse them):
``top_left`` causal alignment, LSE in base 2, dK on the keys of zero-query segments, the
window keywords ignored.
"""

from __future__ import annotations

import math

import torch

from worker_runtime.aten_flash import AtenOps


def _segments(cum_q: torch.Tensor, cum_k: torch.Tensor):
    cq, ck = cum_q.tolist(), cum_k.tolist()
    return [(cq[b], cq[b + 1], ck[b], ck[b + 1]) for b in range(len(cq) - 1)]


def _mask(lq: int, lk: int, is_causal: bool, top_left: bool, left: int | None = None,
          right: int | None = None) -> torch.Tensor:
    """FlashAttention's mask: causal (bottom-right) or full, then the local window
    ``[q - left, q + right]`` around the aligned query position where either is >= 0."""
    t = torch.arange(lq)[:, None]
    s = torch.arange(lk)[None, :]
    aligned = t if top_left else t + (lk - lq)
    mask = s <= aligned if is_causal else torch.ones(lq, lk, dtype=torch.bool)
    if left is not None and left >= 0:
        mask = mask & (s >= aligned - left)
    if right is not None and right >= 0:
        mask = mask & (s <= aligned + right)
    return mask


def _scores(q, k, scale, mask):
    """``[H, lq, lk]`` float64 scores (GQA: KV heads repeated per group), masked to -inf."""
    h, g = q.shape[1], k.shape[1]
    kk = k.double().repeat_interleave(h // g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    return s.masked_fill(~mask, -math.inf)


def variant(*, top_left: bool = False, base2: bool = False, zero_query_dk: bool = False,
            ignore_window: bool = False) -> AtenOps:
    """Stand-in ops; every flag off gives the faithful ones (module docstring;
    ``ignore_window``: the window keywords accepted and dropped)."""

    def window(left, right):
        return (None, None) if ignore_window else (left, right)

    def forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None):
        assert dropout_p == 0.0 and not return_debug_mask
        assert cum_seq_q.dtype == torch.int32 and cum_seq_k.dtype == torch.int32
        t, h, d = query.shape
        g = key.shape[1]
        assert h % g == 0, "KV heads divide the heads"
        scale = d**-0.5 if scale is None else scale
        out = torch.zeros(t, h, d, dtype=torch.float64)
        lse = torch.full((h, t), math.inf, dtype=torch.float64)
        for q0, q1, k0, k1 in _segments(cum_seq_q, cum_seq_k):
            lq, lk = q1 - q0, k1 - k0
            assert lq <= max_q and lk <= max_k
            if lq == 0 or lk == 0:
                continue
            s = _scores(query[q0:q1], key[k0:k1], scale, _mask(lq, lk, is_causal, top_left,
                                                                *window(window_size_left, window_size_right)))
            m = torch.logsumexp(s, dim=-1)  # [H, lq]; -inf where a row sees nothing
            seen = torch.isfinite(m)
            p = torch.exp(s - torch.where(seen, m, 0.0)[..., None]).masked_fill(~seen[..., None], 0.0)
            vv = value[k0:k1].double().repeat_interleave(h // g, dim=1)
            out[q0:q1] = torch.einsum("hqk,khd->qhd", p, vv)
            lse[:, q0:q1] = torch.where(seen, m / math.log(2) if base2 else m, math.inf)
        rng = torch.zeros(2, dtype=torch.uint64)
        return (out.to(query.dtype), lse.float(), rng, torch.empty(0), torch.empty(0))

    def backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                 dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                 window_size_right=None):
        assert dropout_p == 0.0 and logsumexp.dtype == torch.float32
        assert logsumexp.shape == (query.shape[1], query.shape[0]) and logsumexp.is_contiguous()
        t, h, d = query.shape
        g = key.shape[1]
        r = h // g
        scale = d**-0.5 if scale is None else scale
        dq = torch.zeros(t, h, d, dtype=torch.float64)
        dk = torch.zeros(key.shape[0], h, d, dtype=torch.float64)
        dv = torch.zeros_like(dk)
        delta = (grad_out.double() * out.double()).sum(-1).t()  # [H, T]
        for q0, q1, k0, k1 in _segments(cum_seq_q, cum_seq_k):
            lq, lk = q1 - q0, k1 - k0
            if lk == 0:
                continue
            if lq == 0:
                if zero_query_dk:
                    dk[k0:k1] = 1.0
                continue
            s = _scores(query[q0:q1], key[k0:k1], scale, _mask(lq, lk, is_causal, top_left,
                                                                *window(window_size_left, window_size_right)))
            lse = logsumexp[:, q0:q1].double()
            p = torch.exp(s - lse[..., None])  # +inf LSE rows and masked pairs give 0
            do = grad_out[q0:q1].double()
            vv = value[k0:k1].double().repeat_interleave(r, dim=1)
            kk = key[k0:k1].double().repeat_interleave(r, dim=1)
            dv[k0:k1] = torch.einsum("hqk,qhd->khd", p, do)
            dp = torch.einsum("qhd,khd->hqk", do, vv)
            ds = p * (dp - delta[:, q0:q1, None]) * scale
            dq[q0:q1] = torch.einsum("hqk,khd->qhd", ds, kk)
            dk[k0:k1] = torch.einsum("hqk,qhd->khd", ds, query[q0:q1].double())
        # GQA: the kernels compute per query head and sum each group into its KV head.
        dk = dk.view(-1, g, r, d).sum(2)
        dv = dv.view(-1, g, r, d).sum(2)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)

    return AtenOps(forward, backward)


STANDIN = variant()
"""The faithful stand-in."""
