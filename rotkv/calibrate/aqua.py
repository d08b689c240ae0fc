"""``rotkv calibrate --method aqua``: the inter-layer key maps of ``CacheSpec.predict_keys`` (rotkv.cache.predict).

On top of an ``oscar-mix-long`` artifact (its key rotations ``R_K``, key means, clip ratios and key widths), each
layer ``l >= 1`` gets a map ``[H D + 1, H D]`` (fp16; the last row is the bias) from layer ``l - 1``'s pre-RoPE keys
to layer ``l``'s, fitted by ridge least squares on the calibration corpus (rotkv's default ``calib_*.txt`` unless
``--data``). The fit is sequential: layer ``l``'s map is fitted on layer ``l - 1``'s keys as the cache holds them
(the body format: rotated, quantized at the layer's width and clip ratio, turned back), made with the maps of the
layers before it, so it learns to predict from what a cache reads. The first ``SKIP`` tokens of each chunk (the
sink) are left out of the fit. The result is the base artifact plus ``aqua_map.{l}``, of kind
``oscar-mix-long+aqua``.

``layers="odd"`` maps the odd layers only (``aqua_layers`` in the artifact): each predicts from the plain layer
before it, so no read needs more than one other layer's keys (no chain).

``map_class`` restricts the map (``aqua_map_class`` in the artifact; the cache reads every class as the dense matrix
it is stored as):

- ``dense`` (default): any ``[H D + 1, H D]`` map with a bias;
- ``rope``: a map that commutes with RoPE: per frequency pair (dims ``i`` and ``i + D/2`` of each head, the pairs
  ``rotate_half`` turns), a complex ``H x H`` matrix across the KV heads, fitted from layer ``l - 1``'s post-RoPE keys
  less its key mean to layer ``l``'s less its own; the bias row is ``mu_l - mu_{l-1} A`` and is added after RoPE
  (``rotkv.cache.predict``). RoPE multiplies pair ``i`` at position ``t`` by ``exp(j theta_i t)``, which commutes
  with the map, so it can act on the post-RoPE keys as they are: a decode kernel can fold it into the query
  (``q -> q A^T``) and read the previous layer's key codes with it (``k^_{l-1} - mu_{l-1}`` is their decoded,
  turned-back value), with no per-token product, sine or cosine, the bias a constant per query;
- ``rope-head``: the same with one complex number per head and frequency (each head from the same head).
"""

from __future__ import annotations

import time

import torch

from rotkv.cache.predict import MAP_CLASSES, map_name, rope, unrope
from rotkv.quant.quantizer import fake_quantize

SKIP = 16  # tokens at the start of each calibration chunk left out of the fit
KIND = "oscar-mix-long+aqua"
BASE_KIND = "oscar-mix-long"


def _flat(x: torch.Tensor) -> torch.Tensor:  # [H, T, D] -> [T, H * D]
    return x.permute(1, 0, 2).reshape(x.shape[1], -1)


def _unflat(x: torch.Tensor, h: int) -> torch.Tensor:  # [T, H * D] -> [H, T, D]
    return x.reshape(x.shape[0], h, -1).permute(1, 0, 2)


def apply_post_map(A: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """A map that commutes with RoPE (``rope``, ``rope-head``) on the post-RoPE keys ``prev [H, T, D]`` as they are,
    its bias after RoPE: what the cache's prediction equals for such a map."""
    return _unflat(_flat(prev) @ A[:-1] + A[-1], prev.shape[0])


def apply_map(A: torch.Tensor, prev: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The post-RoPE prediction ``[H, T, D]`` from the previous layer's post-RoPE keys ``prev [H, T, D]`` through
    ``A [H D + 1, H D]`` (the last row the bias); ``cos, sin [T, D]``."""
    src = _flat(unrope(prev, cos, sin))
    x = torch.cat([src, torch.ones(src.shape[0], 1, dtype=src.dtype)], -1)
    return rope(_unflat(x @ A, prev.shape[0]), cos, sin)


class KeyStore:
    """What each layer's body holds of a key, in float64: the artifact's rotation ``R_K``, key width and clip ratio."""

    def __init__(self, config, artifact):
        self.layers, h = config.num_hidden_layers, config.num_key_value_heads
        self.head_dim = d = int(artifact.meta["head_dim"])
        self.group = int(artifact.meta.get("group_size", 64))
        self.k_bits = artifact.tensors["k_bits"].tolist()
        self.clip = [float(x) for x in artifact.meta["clip_k"].split(",")]
        self.rk = [artifact.tensors[f"R_K.{i}"].double().expand(h, d, d) for i in range(self.layers)]
        self.mu = [artifact.tensors[f"k_mean.{i}"].double() for i in range(self.layers)]  # [H, D]

    def store(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """What layer ``i``'s body holds of ``x [H, T, D]`` (a centred key or a residual), turned back."""
        b = self.k_bits[i]
        xr = torch.einsum("htd,hde->hte", x, self.rk[i])
        xq = fake_quantize(xr.float(), b, self.group, self.clip[i] if b == 2 else 1.0).double()
        return torch.einsum("hte,hde->htd", xq, self.rk[i])

    def plain(self, k: torch.Tensor, i: int) -> torch.Tensor:
        """What layer ``i``'s body holds of its keys ``k [H, T, D]`` stored plainly (centred, no prediction)."""
        mu = self.mu[i][:, None]
        return self.store(k - mu, i) + mu


LAYER_SETS = ("all", "odd")


def fit_rope_map(x: torch.Tensor, y: torch.Tensor, h: int, ridge: float = 1e-3, per_head: bool = False) -> torch.Tensor:
    """The least-squares map that commutes with RoPE from keys ``x [N, H D]`` to ``y [N, H D]`` (see the module
    docstring; before or after RoPE, the same fit), as a dense ``[H D + 1, H D]`` matrix with a zero bias row. Per
    frequency pair ``f``: ``Y_f ~ X_f C_f`` in complex numbers (``X_f [N, H]``), ridge ``ridge`` times the mean
    diagonal of the Gram matrix; ``per_head``: ``C_f`` diagonal."""
    n, hd = x.shape
    d = hd // h
    f = d // 2
    xc = x.reshape(n, h, d)
    yc = y.reshape(n, h, d)
    zx = torch.complex(xc[..., :f], xc[..., f:])  # [N, H, F]
    zy = torch.complex(yc[..., :f], yc[..., f:])
    out = torch.zeros(hd + 1, hd, dtype=x.dtype)
    for i in range(f):
        a, b = zx[:, :, i], zy[:, :, i]
        g = a.conj().T @ a  # [H, H]
        lam = ridge * torch.diagonal(g).real.mean()
        if per_head:
            c = torch.diag((a.conj() * b).sum(0) / (torch.diagonal(g).real + lam))
        else:
            c = torch.linalg.solve(g + lam * torch.eye(h, dtype=g.dtype), a.conj().T @ b)
        # z_out = z_in c, z = (dim i) + j (dim i + D/2): c[hh, gg] at input head hh's rows, output head gg's columns
        re_, im_ = (torch.arange(h) * d + i)[:, None], (torch.arange(h) * d + i + f)[:, None]
        out[re_, re_.T], out[im_, re_.T] = c.real, -c.imag
        out[re_, im_.T], out[im_, im_.T] = c.imag, c.real
    return out


def layer_set(name: str, num_layers: int) -> list[int]:
    """The layers that ``--aqua-layers NAME`` maps."""
    if name not in LAYER_SETS:
        raise ValueError(f"aqua layers {name!r}: one of {', '.join(LAYER_SETS)}")
    return list(range(1, num_layers, 2 if name == "odd" else 1))


def fit_maps(model, tokenizer, artifact, tokens: int = 16384, chunk: int = 2048, ridge: float = 1e-3,
             files: list[str] | None = None, progress: bool = True,
             layers: str = "all", map_class: str = "dense") -> list[torch.Tensor | None]:
    """``[None, A_1, ..., A_{L-1}]`` (fp16; None for a layer that ``layers`` leaves out) for ``model`` on top of
    ``artifact``, of ``map_class`` (see the module docstring)."""
    from tqdm.auto import tqdm

    from rotkv.calibrate.capture import capturing
    from rotkv.calibrate.corpus import token_chunks

    if map_class not in MAP_CLASSES:
        raise ValueError(f"aqua map class {map_class!r}: one of {', '.join(MAP_CLASSES)}")
    ks = KeyStore(model.config, artifact)
    nl, d, mu, store = ks.layers, ks.head_dim, ks.mu, ks.store
    chunks = token_chunks(tokenizer, files, tokens, chunk)
    if any(c.shape[1] != chunk for c in chunks) or chunk <= SKIP:
        raise ValueError(f"the calibration chunks have to hold {chunk} > {SKIP} tokens")
    calib = []
    dev = next(model.parameters()).device
    for ids in tqdm(chunks, desc="aqua: keys", unit="chunk", disable=not progress):
        got = {}
        with torch.no_grad(), capturing(model, lambda i, q, k, v, o, pr: got.__setitem__(i, k[0].float().cpu())):
            model(input_ids=ids.to(dev))
        calib.append([got[i] for i in range(nl)])
    rot = next(m for name, m in model.named_modules() if name.endswith("rotary_emb"))
    inv = getattr(rot, "inv_freq", None)
    rdev = inv.device if inv is not None else dev
    with torch.no_grad():
        cos, sin = rot(torch.zeros(1, chunk, d, device=rdev), torch.arange(chunk, device=rdev)[None])
    cos, sin = cos[0].double().cpu(), sin[0].double().cpu()
    rec = [ks.plain(c[0].double(), 0) for c in calib]
    maps: list[torch.Tensor | None] = [None]
    ones = torch.ones(chunk - SKIP, 1, dtype=torch.float64)
    mapped = set(layer_set(layers, nl))
    for i in tqdm(range(1, nl), desc="aqua: maps", unit="layer", disable=not progress):
        if i not in mapped:  # a plain layer: what its body holds, as layer 0's
            maps.append(None)
            rec = [ks.plain(c[i].double(), i) for c in calib]
            continue
        if map_class == "dense":
            x = torch.cat([torch.cat([_flat(unrope(r, cos, sin))[SKIP:], ones], -1) for r in rec])
            y = torch.cat([_flat(unrope(c[i].double(), cos, sin))[SKIP:] for c in calib])
            gram = x.T @ x
            reg = torch.eye(gram.shape[0], dtype=gram.dtype) * ridge * torch.diagonal(gram)[:-1].mean()
            reg[-1, -1] = 0
            A = torch.linalg.solve(gram + reg, x.T @ y).half()
        else:  # centred post-RoPE keys; the bias (after RoPE) maps the means
            x = torch.cat([_flat(r - mu[i - 1][:, None])[SKIP:] for r in rec])
            y = torch.cat([_flat(c[i].double() - mu[i][:, None])[SKIP:] for c in calib])
            M = fit_rope_map(x, y, model.config.num_key_value_heads, ridge, map_class == "rope-head")
            M[-1] = mu[i].reshape(-1) - mu[i - 1].reshape(-1) @ M[:-1]
            A = M.half()
        maps.append(A)
        Ad = A.double()
        new = []
        for c, r in zip(calib, rec):
            pr = apply_map(Ad, r, cos, sin) if map_class == "dense" else apply_post_map(Ad, r)
            new.append(pr + store(c[i].double() - pr, i))
        rec = new
    return maps


def calibrate_aqua(loaded, base, tokens: int = 16384, chunk: int = 2048, ridge: float = 1e-3,
                   files: list[str] | None = None, progress: bool = True, layers: str = "all",
                   map_class: str = "dense") -> tuple[dict, dict]:
    """(tensors, meta) of an ``oscar-mix-long+aqua`` artifact: ``base`` (an oscar-mix-long Artifact) plus the maps
    (of ``layers``: ``all`` or ``odd``; of ``map_class``)."""
    from rotkv.contract import kind_meta

    t0 = time.time()
    maps = fit_maps(loaded.model, loaded.tokenizer, base, tokens, chunk, ridge, files, progress, layers, map_class)
    tensors = dict(base.tensors)
    for i, m in enumerate(maps):
        if m is not None:
            tensors[map_name(i)] = m
    meta = dict(base.meta) | kind_meta(KIND, base) | {
        "aqua_tokens": str(tokens), "aqua_chunk": str(chunk), "aqua_ridge": str(ridge),
        "aqua_files": ",".join(files) if files else "default", "aqua_seconds": str(round(time.time() - t0)),
        "aqua_map_bytes": str(sum(m.numel() * 2 for m in maps if m is not None)),
    }
    if map_class != "dense":
        meta["aqua_map_class"] = map_class
    if layers != "all":
        meta["aqua_layers"] = ",".join(str(i) for i, m in enumerate(maps) if m is not None)
    return tensors, meta
