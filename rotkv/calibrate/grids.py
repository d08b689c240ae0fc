"""Calibrated quantizer tables on calibration text: non-uniform 2-bit grids per layer and KV head
(rotkv.quant.grid) and product-quantization codebooks for keys (rotkv.quant.vq).

The stored keys (and values) of the calibration chunks, ``(k - mu) R_K`` as the cache writes them (the
artifact's key mean and rotation), are clipped at the layer's ratio and normalized into their group's
stored range; a Lloyd-Max grid of ``2^b`` levels is fitted per (layer, KV head) to those normalized
values. Layers whose keys are not at ``bits`` (e.g. oscar-mix's 4-bit key layers) get the uniform grid.
The result is ``k_grid`` / ``v_grid`` ``[L, H, 2^b]`` float32, to be stored beside the artifact.
"""

from __future__ import annotations

import torch

from rotkv.quant.grid import lloyd_max, normalized_samples, uniform_grid


@torch.no_grad()
def fit_grids(model, tokenizer, artifact, spec, tokens: int = 4096, chunk_len: int = 512, sink: int = 16,
              files=None) -> dict[str, torch.Tensor]:
    """``{"k_grid", "v_grid"}`` ``[L, H, 2^bits]`` from ``tokens`` calibration tokens (the sink tokens skipped)."""
    from rotkv.cache.widths import resolve_widths
    from rotkv.calibrate.capture import capturing
    from rotkv.calibrate.corpus import token_chunks
    from rotkv.hf.geometry import model_geometry

    layers, kv_heads, head_dim = model_geometry(model.config)
    bits, g = spec.bits, spec.resolved_group(head_dim)
    widths = resolve_widths(spec, layers, artifact)
    rots = [artifact.layer_rotation(i) for i in range(layers)]
    samples: dict[tuple[int, str], list[torch.Tensor]] = {}

    def rec(layer, q, k, v, out, probs):
        r = rots[layer]
        ck = r.clip_k if r.clip_k is not None else spec.clip_k
        cv = r.clip_v if r.clip_v is not None else spec.clip_v
        kr, vr = r.keys(k.float())[0, :, sink:], r.values(v.float())[0, :, sink:]  # [H, T, D]
        if widths[layer].key == bits:
            samples.setdefault((layer, "k"), []).append(normalized_samples(kr, bits, g, ck, spec.meta_k))
        samples.setdefault((layer, "v"), []).append(normalized_samples(vr, bits, g, cv, spec.meta_v))

    dev = next(model.parameters()).device
    with capturing(model, rec):
        for ids in token_chunks(tokenizer, files, tokens, chunk_len):
            model(ids.to(dev), use_cache=False)
    out = {}
    for side in "kv":
        grids = uniform_grid(bits).expand(layers, kv_heads, 1 << bits).clone()
        for layer in range(layers):
            if (layer, side) not in samples:
                continue
            u = torch.cat(samples[(layer, side)], 1)  # [H, T, D]
            for h in range(kv_heads):
                grids[layer, h] = lloyd_max(u[h], bits)
        out[f"{side}_grid"] = grids
    return out


@torch.no_grad()
def stored_keys(model, tokenizer, artifact, tokens: int = 4096, chunk_len: int = 512, sink: int = 16,
                files=None) -> list[torch.Tensor]:
    """Per layer, the stored keys ``(k - mu) R_K`` ``[H, T, D]`` of ``tokens`` calibration tokens (sinks skipped)."""
    from rotkv.calibrate.capture import capturing
    from rotkv.calibrate.corpus import token_chunks
    from rotkv.hf.geometry import model_geometry

    layers = model_geometry(model.config)[0]
    rots = [artifact.layer_rotation(i) for i in range(layers)]
    rows: dict[int, list[torch.Tensor]] = {}

    def rec(layer, q, k, v, out, probs):
        rows.setdefault(layer, []).append(rots[layer].keys(k.float())[0, :, sink:].cpu())

    dev = next(model.parameters()).device
    with capturing(model, rec):
        for ids in token_chunks(tokenizer, files, tokens, chunk_len):
            model(ids.to(dev), use_cache=False)
    return [torch.cat(rows[i], 1) for i in range(layers)]


def fit_pq_books(model, tokenizer, artifact, spec, tokens: int = 4096, sub_dim: int = 4, bits: int = 8,
                 files=None) -> dict[str, torch.Tensor]:
    """``{"pq_book" [L, H, 2^bits, sub_dim], "pq_sigma" [L, H, D]}`` for the stored keys of every layer."""
    from rotkv.quant.vq import fit_pq

    keys = stored_keys(model, tokenizer, artifact, tokens, files=files)
    books, sigmas = zip(*(fit_pq(k, sub_dim, bits) for k in keys))
    return {"pq_book": torch.stack(books), "pq_sigma": torch.stack(sigmas)}
