"""OSCAR's key side refitted on long sequences (``rotkv calibrate --method oscar-mix-long``).

``rotkv calibrate --method oscar`` fits R_K from the query covariance C_Q of 512-token chunks: it sees RoPE
phases of at most 512 positions and the queries of short contexts. This refit keeps an artifact's value side
(R_V), clip ratios and key widths (``k_bits``), and replaces per layer the key mean and ``R_K = U_Q H P_br``
by the same OSCAR fit over calibration sequences of ``seq_len`` tokens: each sequence is prefilled in
``call``-token calls through a DynamicCache with rotkv's capture attention, so the queries of every
position 0..seq_len-1 enter C_Q (summed over the query heads of a KV head, then pooled as the base
artifact's granularity) and every key past the sink enters the mean. Calibration text only.

    rotkv calibrate --method oscar-mix-long --base-artifact oscar-mix.safetensors --long-seq-len 4096,8192 \
        --long-sequences 2 --out oscar-mix-long.safetensors

Several lengths (:func:`refit_lengths`, ``rotkv calibrate --method oscar-mix-long --long-seq-len 4096,8192``)
write one artifact with a key-side fit per length: the first length's as ``R_K``/``k_mean``, the others as
``R_K@n``/``k_mean@n``, listed in ``key_fit_lengths``; a cache picks one by its context length
(``RotkvCache(..., context_length=)``). A fit serves best near its own length.

``key_scale`` (``--key-scale ALPHA``) adds to each fit a key scaling in the query eigenbasis
(:mod:`rotkv.rotations.keyscale`, the artifact's ``k_scale``) from the same sequences' query covariance and
centred key covariance.
"""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm


@torch.no_grad()
def long_stats(model, chunks: list[torch.Tensor], sink: int = 16, call: int = 512, key_moments: bool = False):
    """Per layer: (C_Q ``[H, D, D]`` float64 summed over each KV head's query heads, key sum ``[H, D]``, key count),
    and with ``key_moments`` a fourth: the keys' summed outer products ``[H, D, D]`` (the same keys as the sum)."""
    from transformers import DynamicCache

    from rotkv.calibrate.capture import capturing
    from rotkv.hf import compat

    cq, ks, kn, kk = {}, {}, {}, {}
    pos = [0]

    def rec(layer, q, k, v, out, probs):
        q0, k0 = q[0].double(), k[0].double()  # [Hq, t, D], [H, S, D]: S = the cache so far plus this call
        h, t = k0.shape[0], q0.shape[1]
        g = q0.reshape(h, -1, q0.shape[-1])  # KV head i reads query heads i*n_rep .. (i+1)*n_rep-1
        cq[layer] = cq.get(layer, 0) + torch.einsum("htd,hte->hde", g, g).cpu()
        skip = max(0, sink - pos[0])
        new = k0[:, -t:][:, skip:]
        ks[layer] = ks.get(layer, 0) + new.sum(1).cpu()
        kn[layer] = kn.get(layer, 0) + max(t - skip, 0)
        if key_moments:
            kk[layer] = kk.get(layer, 0) + torch.einsum("htd,hte->hde", new, new).cpu()

    dev = next(model.parameters()).device
    calls = sum(-(-ids.shape[1] // call) for ids in chunks)
    with capturing(model, rec), tqdm(total=calls, desc=f"key statistics ({len(chunks)} x {chunks[0].shape[1]} tokens)",
                                     unit="call", leave=False) as bar:
        for ids in chunks:
            cache = DynamicCache()
            for c0 in range(0, ids.shape[1], call):
                pos[0] = c0
                model(input_ids=ids[:, c0:c0 + call].to(dev), use_cache=True, logits_to_keep=1,
                      **{compat.cache_kwarg(model): cache})
                bar.update()
    return (cq, ks, kn, kk) if key_moments else (cq, ks, kn)


def refit(model, tokenizer, artifact, seq_len: int = 4096, sequences: int = 2, call: int = 512, files=None,
          key_scale: float | None = None):
    """(tensors, metadata) of ``artifact`` with R_K and the key means refitted on long sequences; with
    ``key_scale`` (the exponent alpha of :func:`rotkv.rotations.keyscale.key_scale`) a ``k_scale`` per layer too."""
    from rotkv.calibrate.corpus import token_chunks
    from rotkv.contract import kind_meta
    from rotkv.rotations.artifact import without_key_fits
    from rotkv.rotations.base import pooled
    from rotkv.rotations.keyscale import key_scale as key_scale_matrix
    from rotkv.rotations.oscar import oscar_rotation

    if seq_len < call or sequences < 1:
        raise ValueError(f"`seq_len` has to be >= `call` ({call}) and `sequences` >= 1 but got {seq_len}, {sequences}")
    chunks = token_chunks(tokenizer, files, seq_len * sequences, seq_len)
    if chunks[0].shape[1] < seq_len:
        raise ValueError(f"the calibration text is shorter than one sequence of {seq_len} tokens")
    t0 = time.time()
    stats = long_stats(model, chunks, int(artifact.meta.get("sink", 16)), call, key_moments=key_scale is not None)
    cq, ks, kn = stats[:3]
    tensors, base_meta = without_key_fits(artifact.tensors, artifact.meta)  # the key side is replaced whole
    tensors = {k: v for k, v in tensors.items() if not k.startswith("k_scale.")}
    base_meta.pop("key_scale", None)
    gran = artifact.meta.get("granularity", "layer")
    for layer in cq:
        old = tensors[f"R_K.{layer}"]
        tensors[f"R_K.{layer}"] = oscar_rotation(pooled(cq[layer], gran))[:old.shape[0]].contiguous()
        tensors[f"k_mean.{layer}"] = (ks[layer] / kn[layer]).float()
        if key_scale is not None:
            mu = ks[layer] / kn[layer]  # [H, D] float64
            ck = stats[3][layer] / kn[layer] - torch.einsum("hd,he->hde", mu, mu)
            s = key_scale_matrix(pooled(cq[layer], gran), pooled(ck, gran), key_scale)
            tensors[f"k_scale.{layer}"] = s[:old.shape[0]].contiguous()
    meta = base_meta | {"longfit_seq_len": str(seq_len), "longfit_tokens": str(sum(c.shape[1] for c in chunks)),
                        "longfit_seconds": f"{time.time() - t0:.0f}"}
    if key_scale is not None:
        meta["key_scale"] = f"{key_scale:g}"
    kind = artifact.kind if artifact.kind.endswith("-long") else f"{artifact.kind}-long"  # oscar-mix -> oscar-mix-long
    meta |= kind_meta(kind, artifact)
    return tensors, meta


def refit_lengths(model, tokenizer, artifact, seq_lens: list[int], sequences: int = 2, call: int = 512,
                  files=None, log=print, key_scale: float | None = None):
    """(tensors, metadata) of ``artifact`` with one key-side fit per length of ``seq_lens`` (:func:`refit` each):
    the first's as ``R_K.l``/``k_mean.l``, each other's as ``R_K@n.l``/``k_mean@n.l``, and ``key_fit_lengths``
    listing them. R_V, clips and key widths are the base's, shared. One length gives :func:`refit`'s artifact
    unchanged (no ``key_fit_lengths``)."""
    from rotkv.rotations.artifact import KEY_FIT_SIDE

    seq_lens = list(seq_lens)
    if not seq_lens or len(set(seq_lens)) != len(seq_lens):
        raise ValueError(f"`seq_lens` has to be distinct lengths but got {seq_lens}")
    tensors, meta = None, None
    seconds, tokens = [], []
    for n in seq_lens:
        log(f"refitting R_K and the key means on {sequences} sequences of {n} tokens ...")
        t, m = refit(model, tokenizer, artifact, n, sequences, call, files, key_scale)
        seconds.append(m["longfit_seconds"])
        tokens.append(m["longfit_tokens"])
        if tensors is None:
            tensors, meta = t, m
            continue
        for name, v in t.items():
            prefix, _, idx = name.partition(".")
            if prefix in KEY_FIT_SIDE:
                tensors[f"{prefix}@{n}.{idx}"] = v
    if len(seq_lens) > 1:
        meta |= {"key_fit_lengths": ",".join(str(n) for n in seq_lens), "key_fit_seconds": ",".join(seconds),
                 "key_fit_tokens": ",".join(tokens)}
    return tensors, meta


# the key fits an oscar-mix-long artifact gets by default (rotkv calibrate and rotkv eval/demo's calibration): one
# per length, a cache picking the one nearest its context
DEFAULT_FIT_LENGTHS = (4096, 8192)


def calibrate_mix_long(loaded, base=None, seq_len: int | list[int] | tuple[int, ...] = DEFAULT_FIT_LENGTHS,
                       sequences: int = 2, files=None, log=print,
                       layers: int | None = None, key_scale: float | None = None, **mix) -> tuple[dict, dict]:
    """(tensors, metadata) of a complete ``oscar-mix-long`` artifact: R_K and the key means refitted on
    ``sequences`` sequences of ``seq_len`` tokens (:func:`refit`) over ``base``'s (an Artifact or a path);
    a list of lengths gives one fit per length (:func:`refit_lengths`, the first the primary).
    A base with key widths (an oscar-mix artifact) keeps them, or with ``layers`` gets 4-bit keys in the
    ``layers`` layers of largest ``k_gain``; a base without them first gets them
    (:func:`rotkv.calibrate.keybits.calibrate_mix`, ``layers`` and ``mix`` its arguments)."""
    import numpy as np

    from rotkv.calibrate.keybits import calibrate_mix, check_layers, with_key_bits
    from rotkv.rotations.artifact import Artifact, load_artifact

    art = load_artifact(base) if isinstance(base, str) else base
    given = art  # the artifact on disk (or given), which the result names as its base
    if layers is not None:
        check_layers(layers, loaded.model.config.num_hidden_layers, "--key-layers")
    if art is not None and "k_bits" in art.tensors and art.kind not in ("oscar-mix", "oscar-mix-long"):
        raise ValueError(f"the base artifact {art.path} is {art.describe()}; oscar-mix-long is made from an oscar, "
                         "oscar-mix or oscar-mix-long artifact")
    if art is None or "k_bits" not in art.tensors:
        tensors, meta = calibrate_mix(loaded, art, layers, files=files, log=log, **mix)
        art = Artifact(tensors, {k: str(v) for k, v in meta.items()})
    elif layers is not None and (have := int((art.tensors["k_bits"] == 4).sum())) != layers:
        if "k_gain" not in art.tensors:
            raise ValueError(f"the base artifact has 4-bit keys in {have} layers "
                             f"and no k_gain ranking to choose {layers} from: calibrate it with rotkv calibrate --method oscar-mix")
        tensors, meta = with_key_bits(art, art.tensors["k_gain"].double().numpy(), layers)
        meta["keybits_layers"] = ",".join(str(i) for i in np.flatnonzero(tensors["k_bits"].numpy() == 4))
        log(f"4-bit keys in {layers} layers by the base's k_gain: {meta['keybits_layers']}")
        art = Artifact(tensors, {k: str(v) for k, v in meta.items()})
    seq_lens = [seq_len] if isinstance(seq_len, int) else list(seq_len)
    tensors, meta = refit_lengths(loaded.model, loaded.tokenizer, art, seq_lens, sequences, files=files, log=log,
                                  key_scale=key_scale)
    if given is not None and art is not given:  # re-ranked in memory: name the base it was made from, not that copy
        meta["base_artifact"] = f"{given.kind} {given.identity}"
    return tensors, meta
