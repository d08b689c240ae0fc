"""OptR (METHODS 3.4): per KV head ``R = R_base expm(A - A^T)``, learned against the error after W_O.

All KV heads of a layer train together (``A [H, D, D]``): the loss is a sum of per-head terms and
Adam is elementwise, so this equals training each head alone, at a fraction of the overhead.
Rounding is passed straight through. Keys first, loss ``KL(p_fp || p_q) + lam * rel_out`` where
``rel_out = ||((p_q - p_fp) V) W_O^T||^2 / ||p_fp V W_O^T||^2`` (the relative normalization is
a choice: it puts the two terms on one scale at every layer); then values with the keys fixed,
``||p_q dV W_O^T||^2 / ||p_fp V W_O^T||^2``. The
loss is taken on ``n_queries`` query positions per chunk (all keys), a choice that makes a step ~4x cheaper. The held-out loss is checked every
``eval_every`` steps, the best A per head is kept, and a head keeps its new R only if that beats R_base.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def ste_fake_quant(x: torch.Tensor, bits: int, group: int, clip: float) -> torch.Tensor:
    """Differentiable fake quantization of rows ``x [..., D]``: round() passed straight through."""
    d = x.shape[-1]
    if clip < 1.0:
        t = torch.kthvalue(x.abs(), int(clip * d) + 1, dim=-1, keepdim=True).values
        x = torch.minimum(torch.maximum(x, -t), t)
    g = x.reshape(*x.shape[:-1], d // group, group)
    lo = g.amin(-1, keepdim=True)
    scale = ((g.amax(-1, keepdim=True) - lo) / ((1 << bits) - 1)).clamp_min(1e-8)
    c = (g - lo) / scale
    c = c + (torch.round(c).clamp(0, (1 << bits) - 1) - c).detach()
    return (c * scale + lo).reshape(x.shape)


@dataclass
class HeadProblem:
    """One chunk, grouped by KV head: ``q [H, r, M, D]`` (M sampled query rows), ``k, v [H, T, D]``
    (keys centered), ``gram [H, r, r, D, D]`` (``W_O,h^T W_O,h'`` of the query heads of each KV head)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    gram: torch.Tensor
    mask: torch.Tensor  # [M, T] True where a key is in the future of the query
    logp_fp: torch.Tensor  # [H, r, M, T]
    y_ref_sq: torch.Tensor  # [H] ||p_fp V W_O^T||^2


def make_problem(sample, mu, w_o: torch.Tensor, scaling: float, sink: int = 16, n_queries: int = 128) -> HeadProblem:
    """Build one chunk's problem; queries are ``n_queries`` positions spread evenly over ``[sink, T)``
    (the loss over all T queries costs T/M times more and early queries see mostly the sink)."""
    h, t, d = sample.k.shape
    r = sample.q.shape[0] // h
    pos = torch.linspace(min(sink, t - 1), t - 1, min(n_queries, t), device=sample.k.device).round().long().unique()
    q = sample.q.reshape(h, r, t, d)[:, :, pos]
    k = sample.k - (0 if mu is None else mu[:, None])
    w = w_o.reshape(w_o.shape[0], h, r, d).permute(1, 2, 0, 3)  # [H, r, hidden, D]
    gram = torch.einsum("gahd,gbhe->gabde", w, w).contiguous()
    mask = torch.arange(t, device=pos.device)[None, :] > pos[:, None]
    logp = _logp(q, k, scaling, mask)
    y = _sq_out(logp.exp() @ sample.v[:, None], gram)
    return HeadProblem(q, k, sample.v, gram, mask, logp, y)


def _logp(q, k, scaling, mask):
    s = (q @ k[:, None].transpose(-1, -2)) * scaling
    return torch.log_softmax(s.masked_fill(mask, -1e9), -1)  # finite: 0 * (logp_fp - logq) stays 0


def _sq_out(o, gram):
    """``||sum_h o_h W_O,h^T||^2`` per KV head, ``o [H, r, M, D]`` -> ``[H]`` (through the Gram blocks:
    D x D per head pair instead of a projection to the hidden size)."""
    z = torch.einsum("gamd,gabde->gbme", o, gram)
    return (z * o).sum((1, 2, 3))


def expm_skew(a: torch.Tensor) -> torch.Tensor:
    """``expm(a - a^T)`` ``[..., D, D]`` by scaling and squaring a Taylor series (matmuls only: its
    backward is far cheaper than torch.matrix_exp's, which doubles the matrix size)."""
    s = a - a.transpose(-1, -2)
    norm = s.detach().abs().sum(-2).amax().item()  # 1-norm bound
    k = max(0, int(torch.tensor(norm / 0.25).log2().ceil().item())) if norm > 0.25 else 0
    s = s / (2**k)
    eye = torch.eye(s.shape[-1], dtype=s.dtype, device=s.device).expand_as(s)
    term, out = eye, eye
    for i in range(1, 10):  # ||s|| <= 1/4: the 10th term is below 1e-12
        term = term @ s / i
        out = out + term
    for _ in range(k):
        out = out @ out
    return out


def _stored(x, rot, bits, group, clip, sink):
    """Rows ``x [H, T, D]`` rotated by ``rot [H, D, D]``, body fake-quantized (STE), rotated back."""
    xr = x @ rot
    xq = torch.cat([xr[:, :sink], ste_fake_quant(xr[:, sink:], bits, group, clip)], 1)
    return xq @ rot.transpose(-1, -2)


def key_loss(p: HeadProblem, rk, bits, group, clip_k, sink, scaling, lam=1.0):
    logq = _logp(p.q, _stored(p.k, rk, bits, group, clip_k, sink), scaling, p.mask)
    pf = p.logp_fp.exp()
    kl = (pf * (p.logp_fp - logq)).sum(-1).mean((1, 2))
    return kl + lam * _sq_out((logq.exp() - pf) @ p.v[:, None], p.gram) / p.y_ref_sq


def value_loss(p: HeadProblem, pq, rv, bits, group, clip_v, sink):
    dv = _stored(p.v, rv, bits, group, clip_v, sink) - p.v
    return _sq_out(pq @ dv[:, None], p.gram) / p.y_ref_sq


def _train(loss_fn, r_base, steps, lr, eval_every):
    """Minimize ``loss_fn(R, split) -> [H]`` over ``R = R_base expm(A - A^T)``; returns (R, base, best held-out)."""
    a = torch.zeros_like(r_base, requires_grad=True)
    opt = torch.optim.Adam([a], lr=lr)
    rot = lambda: r_base @ expm_skew(a)  # noqa: E731
    with torch.no_grad():
        base = loss_fn(r_base, "heldout")
    best, best_a = base.clone(), torch.zeros_like(r_base)
    for step in range(1, steps + 1):
        opt.zero_grad()
        loss_fn(rot(), "train").sum().backward()
        opt.step()
        if step % eval_every == 0 or step == steps:
            with torch.no_grad():
                cur = loss_fn(rot(), "heldout")
                better = cur < best
                best = torch.where(better, cur, best)
                best_a[better] = a.detach()[better]
    with torch.no_grad():
        r = r_base @ expm_skew(best_a)
    return r, base, best


def optimize_layer(train, heldout, r_k, r_v, mu, w_o, bits, group, clip_k, clip_v, sink, scaling,
                   steps=80, lr=0.02, eval_every=20, lam=1.0, n_queries=128):
    """Learn R_K then R_V ``[H, D, D]`` for one layer; returns (R_K, R_V, info dict)."""
    sets = {"train": [make_problem(s, mu, w_o, scaling, sink, n_queries) for s in train],
            "heldout": [make_problem(s, mu, w_o, scaling, sink, n_queries) for s in heldout]}

    def kl(rk, split):
        return sum(key_loss(p, rk, bits, group, clip_k, sink, scaling, lam) for p in sets[split]) / len(sets[split])

    new_k, k_base, k_best = _train(kl, r_k.float(), steps, lr, eval_every)
    with torch.no_grad():
        pq = {s: [_logp(p.q, _stored(p.k, new_k, bits, group, clip_k, sink), scaling, p.mask).exp() for p in ps]
              for s, ps in sets.items()}

    def vl(rv, split):
        return sum(value_loss(p, m, rv, bits, group, clip_v, sink) for p, m in zip(sets[split], pq[split])) / len(sets[split])

    new_v, v_base, v_best = _train(vl, r_v.float(), steps, lr, eval_every)
    info = {"key_base": k_base.tolist(), "key_best": k_best.tolist(),
            "value_base": v_base.tolist(), "value_best": v_best.tolist(),
            "heads_improved_k": int((k_best < k_base).sum()), "heads_improved_v": int((v_best < v_base).sum())}
    return new_k, new_v, info
