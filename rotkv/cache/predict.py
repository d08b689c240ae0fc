"""Inter-layer key prediction (``CacheSpec.predict_keys``, the ``oscar-aqua`` preset).

Layer ``l >= 1`` stores its body keys as the residual against a prediction from layer ``l - 1``'s stored keys of
the same tokens. For a body token at position ``t`` (page ``i`` of its row's body, offset ``j``:
``t = sink + P i + j``):

    p_l = RoPE_t(unRoPE_t(k^_{l-1}) A_l + b_l)                 (the keys of all KV heads at once, [H D])
    stored: Q((k_l - mu_l) R_K - (p_l - mu_l) R_K)             (the layer's token codec, its bytes unchanged)
    read:   (p_l - mu_l) R_K + Q^-1(...)                        (the refine tier, if any, adds its bits on top)

Maps of the classes that commute with RoPE (``rotkv calibrate --method aqua --aqua-map rope|rope-head``, the
artifact's ``aqua_map_class``) are fitted on mean-centred post-RoPE keys; their last row is a bias added after RoPE:
``p_l = RoPE_t(unRoPE_t(k^_{l-1}) A_l) + b_l`` (with ``A_l`` commuting with RoPE, ``k^_{l-1} A_l + b_l``).

``k^_{l-1}`` is what layer ``l - 1``'s body holds of the token without its refine bits (a page loses them when
it ages, so a prediction from them would drift under the stored residual): its own prediction plus its decoded
residual; layer 0 stores and reads its keys as the plain format does. The maps act before RoPE: both layers'
pre-RoPE keys are linear images of the same token's hidden state, so one map serves every position, and unRoPE is
exact given the position. ``A_l`` and ``b_l`` are the artifact's ``aqua_map.{l}``, ``[H D + 1, H D]`` fp16 (the
last row is ``b_l``; ``rotkv calibrate --method aqua``, :mod:`rotkv.calibrate.aqua`). An artifact may map only some layers (its
``aqua_layers``, e.g. the odd ones: ``--aqua-layers odd``); the others store and read their keys as layer 0 does,
and a predicted layer then reads a plain one, with no chain behind it.

Nothing is kept beyond the format's bytes. Within one forward the layers run in order; each leaves
``unRoPE(k^_l)`` of every body page it decodes or writes in a transient buffer (:class:`KeyChain`, float32, by body
page id), which the next layer reads and the layer after that reuses. A flush (prefill or decode) predicts from the
same buffer the reads use, so a page's stored residual and its later reads agree (up to float rounding order).
The buffer is made anew by every forward: reading layer ``l`` outside one (``HybridLayer.read``) replays layers
``0 .. l - 1`` first (:meth:`KeyChain.replay`).

Kernels read one layer's pages only, so a predicting layer runs the PyTorch path: its pools turn off the decode,
dequantize and key-write kernels (``rotkv.cache.pools``), and the CUDA-graph decoder and the vLLM backend refuse the
spec. Positions are counted in real tokens (the first real token of a row at 0), as ``generate`` numbers them.
"""

from __future__ import annotations

import numpy as np
import torch

from rotkv.config import KEY_MAP_CLASSES
from rotkv.rotations.artifact import ArtifactMismatch

MAP_PREFIX = "aqua_map"  # the artifact's tensors: aqua_map.{l}, l = 1 .. L - 1


def map_name(layer: int) -> str:
    return f"{MAP_PREFIX}.{layer}"


def map_bytes(maps) -> int:
    """Bytes of the maps as the artifact stores them (fp16), per model."""
    return sum(m.numel() * 2 for m in maps if m is not None)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    return torch.cat((-x[..., d // 2:], x[..., : d // 2]), -1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers applies it (``x cos + rotate_half(x) sin``)."""
    return x * cos + rotate_half(x) * sin


def unrope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`rope` (``cos^2 + sin^2 = 1`` per pair)."""
    return x * cos - rotate_half(x) * sin


MAP_CLASSES = KEY_MAP_CLASSES  # rotkv calibrate --method aqua --aqua-map
POST_BIAS_CLASSES = tuple(c for c in MAP_CLASSES if c != "dense")  # their bias row is added after RoPE


def bias_after_rope(meta: dict) -> bool:
    """Whether an artifact's maps add their bias after RoPE (their class commutes with RoPE; module docstring)."""
    return meta.get("aqua_map_class", "dense") in POST_BIAS_CLASSES


def load_key_maps(artifact, spec_name: str, num_layers: int, kv_heads: int, head_dim: int) -> list:
    """``[None, A_1, ..., A_{L-1}]`` (fp16 ``[H D + 1, H D]``) from ``artifact``; ArtifactMismatch naming the preset
    and the command that makes them where a map is missing or has another model's shape."""
    from rotkv.contract import make_command

    if any(name.partition(".")[0] == "k_scale" for name in artifact.tensors):
        raise ArtifactMismatch(f"artifact {artifact.path} scales its keys (k_scale); preset {spec_name!r} "
                               "(`predict_keys`) needs orthogonal key rotations")
    n = kv_heads * head_dim
    cls = artifact.meta.get("aqua_map_class", "dense")
    if cls not in MAP_CLASSES:
        raise ArtifactMismatch(f"artifact {artifact.path}: aqua_map_class {cls!r} is none of "
                               f"{', '.join(MAP_CLASSES)} (made by a newer rotkv?)")
    want = predicted_layers(artifact.meta, num_layers, str(artifact.path))
    missing = [layer for layer in want if map_name(layer) not in artifact.tensors]
    if missing:
        have = "" if len(missing) == len(want) else f" (missing for layers {missing[:8]})"
        raise ArtifactMismatch(
            f"artifact {artifact.path} is {artifact.describe()} without the inter-layer key maps{have} that preset "
            f"{spec_name!r} (`predict_keys`) reads; make them with `{make_command('oscar-mix-long+aqua', artifact)}`")
    maps = [None] * num_layers
    for layer in want:
        m = artifact.tensors[map_name(layer)]
        if tuple(m.shape) != (n + 1, n) or not m.dtype.is_floating_point:
            raise ArtifactMismatch(
                f"artifact {artifact.path}: tensor {map_name(layer)!r} has shape {tuple(m.shape)} ({m.dtype}); preset "
                f"{spec_name!r} needs ({n + 1}, {n}) floats for a model of {kv_heads} KV heads of {head_dim} dims")
        if not bool(torch.isfinite(m).all()):
            raise ArtifactMismatch(f"artifact {artifact.path}: tensor {map_name(layer)!r} holds non-finite values")
        maps[layer] = m
    extra = [name for name in artifact.tensors if name.partition(".")[0] == MAP_PREFIX
             and not (name.partition(".")[2].isdigit() and 1 <= int(name.partition(".")[2]) < num_layers)]
    unlisted = [name for name in artifact.tensors if name.partition(".")[0] == MAP_PREFIX and name not in extra
                and int(name.partition(".")[2]) not in want]
    if unlisted:
        raise ArtifactMismatch(f"artifact {artifact.path}: tensor {unlisted[0]!r} is a map of a layer that its "
                               f"`aqua_layers` ({artifact.meta.get('aqua_layers')}) leaves out")
    if extra:
        raise ArtifactMismatch(f"artifact {artifact.path}: tensor {extra[0]!r} names no layer 1..{num_layers - 1} of "
                               f"this model (maps for another model?)")
    return maps


def predicted_layers(meta: dict, num_layers: int, where: str = "artifact") -> list[int]:
    """The layers an artifact's maps predict: its ``aqua_layers`` (``rotkv calibrate --method aqua --aqua-layers``;
    the other layers store their keys as the plain format does), else every layer ``1 .. L - 1``."""
    text = meta.get("aqua_layers")
    if not text:
        return list(range(1, num_layers))
    try:
        layers = sorted({int(x) for x in text.split(",")})
    except ValueError:
        raise ArtifactMismatch(f"{where}: aqua_layers {text!r} is not a comma-separated list of layer indices") from None
    if not layers or layers[0] < 1 or layers[-1] >= num_layers:
        raise ArtifactMismatch(f"{where}: aqua_layers {text!r} names layers outside 1..{num_layers - 1}")
    return layers


def rotary_of(model):
    """The model's rotary embedding module, checked to be a plain rotation (unRoPE exact); ValueError otherwise."""
    found = [m for name, m in model.named_modules() if name.endswith("rotary_emb")]
    if len(found) != 1:
        raise ValueError(f"`predict_keys` needs one rotary embedding in the model (found {len(found)})")
    rot = found[0]
    if float(getattr(rot, "attention_scaling", 1.0)) != 1.0:
        raise ValueError("`predict_keys` needs RoPE without attention scaling (its inverse is then exact)")
    return rot


class KeyChain:
    """What a cache's predicting layers share: the RoPE tables and the per-forward buffers of ``unRoPE(k^_l)``
    (``[pages, H, P, D]`` float32 by body page id); see the module docstring."""

    def __init__(self, rotary, sink: int, page: int, kv_heads: int, head_dim: int):
        self.rotary, self.sink, self.page, self.kv_heads, self.head_dim = rotary, sink, page, kv_heads, head_dim
        self.layers: list = []  # the cache's layers, in order (set by attach)
        self.token = None  # the forward the buffers belong to
        self.fresh: set[int] = set()  # layers that left their keys in this forward
        self.held: dict[int, torch.Tensor] = {}
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def begin(self, token) -> None:
        """A layer starts a forward ``token`` (the cache's plan of the call): a new one forgets what was left."""
        if token is not self.token:
            self.token, self.fresh = token, set()

    def tables(self, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [>= n, D]`` float32 on ``device`` for positions ``0 .. n - 1`` (the model's rotary module)."""
        t = self._tables
        if t is None or t[0].shape[0] < n or t[0].device != torch.device(device):
            size = max(n, 2 * t[0].shape[0] if t is not None else 4096)
            inv = getattr(self.rotary, "inv_freq", None)
            dev = inv.device if inv is not None else device
            x = torch.zeros(1, 1, self.head_dim, dtype=torch.float32, device=dev)
            with torch.no_grad():
                cos, sin = self.rotary(x, torch.arange(size, device=dev)[None])
            if cos.shape[-1] != self.head_dim:
                raise ValueError(f"`predict_keys` needs RoPE over the whole head ({self.head_dim} dims), got "
                                 f"{cos.shape[-1]}")
            self._tables = t = (cos[0].float().to(device), sin[0].float().to(device))
        return t

    def leave(self, layer: int, ids: torch.Tensor, keys: torch.Tensor, capacity: int) -> None:
        """Layer ``layer`` leaves ``unRoPE(k^)`` ``keys [n, H, P, D]`` of body pages ``ids [n]`` (distinct)."""
        buf = self.held.get(layer)
        if buf is None or buf.shape[0] < capacity or buf.device != keys.device:
            # a buffer no layer reads any more (an earlier layer's but the previous one's, or any of an earlier
            # forward's) lends its memory
            old = next((k for k in self.held if k != layer and k != layer - 1 and (k < layer or k not in self.fresh)),
                       None)
            spare = self.held.pop(old) if old is not None else None
            if spare is None or spare.shape[0] < capacity or spare.device != keys.device:
                spare = torch.zeros(capacity, *keys.shape[1:], dtype=torch.float32, device=keys.device)
            if buf is not None and layer in self.fresh:
                spare[: buf.shape[0]] = buf
            self.held[layer] = buf = spare
        self.fresh.add(layer)
        with torch.inference_mode(buf.is_inference()):  # a buffer made inside inference mode is written there
            buf[ids] = keys

    def previous(self, layer: int) -> torch.Tensor:
        """The buffer layer ``layer - 1`` left in this forward; RuntimeError where it left none."""
        if layer - 1 not in self.fresh:
            raise RuntimeError(f"layer {layer} predicts its keys from layer {layer - 1}'s, which left none in this "
                               "forward (`predict_keys` needs the layers to run in order within each forward)")
        return self.held[layer - 1]

    def replay(self, upto: int, row: int) -> None:
        """Decode the body keys of ``row`` in layers ``0 .. upto - 1``, in order, as a forward would (so that layer
        ``upto`` can read them outside a forward)."""
        self.begin(object())
        for layer in self.layers[:upto]:
            st = layer.state
            n = int(st.body_count[row])
            pages = torch.as_tensor(st.body_pages[row, :n], device=layer.device)
            layer.pools.decode_pages(pages[None], 0, None, counts=np.array([n]))


class KeyPredictor:
    """One layer's side of the prediction: its map (None for layer 0), rotation and key mean, and the chain."""

    def __init__(self, layer: int, key_map: torch.Tensor | None, chain: KeyChain, post_bias: bool = False):
        self.layer, self.key_map, self.chain, self.post_bias = layer, key_map, chain, post_bias
        self.A = self.R = self.mu = None

    def bind(self, rotation, device) -> None:
        """Take the layer's rotation (``R_K [H, D, D]``, ``k_mean [H, D]``) and the map onto ``device``."""
        h, d = self.chain.kv_heads, self.chain.head_dim
        self.R = rotation.R_K.float().to(device).expand(h, d, d)
        self.mu = rotation.k_mean.float().to(device) if rotation.k_mean is not None else torch.zeros(h, d, device=device)
        self.A = None if self.key_map is None else self.key_map.float().to(device)

    def _trig(self, index: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin [n, 1, P, D]`` of the tokens of the pages at body indices ``index [n]``."""
        p = self.chain.page
        pos = self.chain.sink + p * index.to(device)[:, None] + torch.arange(p, device=device)[None]
        cos, sin = self.chain.tables(int(pos.max()) + 1 if pos.numel() else 1, device)
        return cos[pos][:, None], sin[pos][:, None]

    def predict(self, ids: torch.Tensor, trig) -> torch.Tensor | None:
        """The post-RoPE prediction ``p [n, H, P, D]`` of the pages ``ids`` from the previous layer's buffer; None
        for layer 0."""
        if self.A is None:
            return None
        prev = self.chain.previous(self.layer)[ids]  # [n, H, P, D] unRoPE'd
        n, h, p, d = prev.shape
        x = prev.permute(0, 2, 1, 3).reshape(n * p, h * d)
        if self.post_bias:  # a map that commutes with RoPE, its bias after RoPE
            pre = torch.mm(x, self.A[:-1]).reshape(n, p, h, d).permute(0, 2, 1, 3)
            return rope(pre, *trig) + self.A[-1].reshape(h, d)[None, :, None]
        pre = torch.addmm(self.A[-1], x, self.A[:-1]).reshape(n, p, h, d).permute(0, 2, 1, 3)
        return rope(pre, *trig)

    def _rotate(self, k: torch.Tensor) -> torch.Tensor:  # post-RoPE keys -> (k - mu) R_K
        return torch.einsum("nhpd,hde->nhpe", k - self.mu[None, :, None], self.R)

    def _leave(self, ids, pred, decoded, trig, capacity: int) -> None:
        """Leave ``unRoPE(k^)`` of pages ``ids``: ``pred`` (post-RoPE, None: layer 0) plus the decoded residual."""
        k = torch.einsum("nhpe,hde->nhpd", decoded, self.R)
        k = k + (pred if pred is not None else self.mu[None, :, None])
        self.chain.leave(self.layer, ids, unrope(k, *trig), capacity)

    def read(self, x: torch.Tensor, ids: torch.Tensor, index: torch.Tensor, valid: torch.Tensor | None,
             capacity: int) -> torch.Tensor:
        """The stored keys ``(k - mu) R_K`` of body pages ``ids [n]`` (body indices ``index [n]``) from their decoded
        residuals ``x [n, H, P, D]`` float32; leaves ``k^`` of the ``valid`` ones (None: all) for the next layer."""
        trig = self._trig(index, x.device)
        pred = self.predict(ids, trig)
        if valid is None:
            self._leave(ids, pred, x, trig, capacity)
        else:
            sel = lambda t: t[valid] if t is not None else None  # noqa: E731
            self._leave(ids[valid], sel(pred), x[valid], tuple(t[valid] for t in trig), capacity)
        return x if pred is None else x + self._rotate(pred)

    def residual(self, x: torch.Tensor, ids: torch.Tensor, index: torch.Tensor):
        """``(x - (p - mu) R_K, p)`` for the exact rotated keys ``x [n, H, P, D]`` of the pages a flush writes to
        ``ids`` (body indices ``index``); ``p`` is None for layer 0."""
        trig = self._trig(index, x.device)
        pred = self.predict(ids, trig)
        x = x.float()
        return (x if pred is None else x - self._rotate(pred)), (pred, trig)

    def wrote(self, ids: torch.Tensor, decoded: torch.Tensor, state, capacity: int) -> None:
        """After a flush: leave ``k^`` of the pages written to ``ids`` (``decoded``: their decoded residual, without
        refine bits; ``state``: :meth:`residual`'s second value)."""
        pred, trig = state
        self._leave(ids, pred, decoded, trig, capacity)


def attach(cache, model, key_maps, post_bias: bool = False) -> KeyChain:
    """Give every paged layer of ``cache`` its :class:`KeyPredictor` over one :class:`KeyChain` (``post_bias``: the
    maps add their bias after RoPE, :func:`bias_after_rope`)."""
    from rotkv.cache.layer import HybridLayer

    if not all(isinstance(layer, HybridLayer) for layer in cache.layers):
        raise ValueError(f"preset {cache.spec.name!r} (`predict_keys`) needs every layer in rotkv's paged pools (no "
                         "sliding-window or budgeted layers)")
    chain = KeyChain(rotary_of(model), cache.spec.sink, cache.spec.page_size, cache.kv_heads, cache.head_dim)
    chain.layers = list(cache.layers)
    for layer, m in zip(cache.layers, key_maps):
        layer.predict = KeyPredictor(layer.layer_idx, m, chain, post_bias)
    return chain
