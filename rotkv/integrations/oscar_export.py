"""Export a rotkv artifact as the K/V rotation checkpoint pair that OSCAR's SGLang integration loads.

The layout follows OSCAR's loader (github.com/FutureMLS-Lab/OSCAR,
``python/sglang/srt/mem_cache/memory_pool.py``: ``load_oscar_rotations``,
``load_oscar_rotation_field``; file names from ``oscar_rotation_paths.py``; the checkpoint state
written by ``oscar_calibration.py``'s ``_checkpoint_state``):

- two ``torch.save`` files, ``k_rotation_qqt_r_h_pbr.pt`` and ``v_rotation_sst_r_h_pbr.pt``, each a
  dict ``{"format_version": 1, "objective", "source_grouping", "calibration": {...},
  "layers": {layer_id: {"layer_id", "rotation", ...}}}`` keyed by the global (int) layer id;
- ``rotation`` is float32 ``[head_dim, head_dim]`` when every KV head of the layer shares one matrix
  (OSCAR's "V1") and ``[num_kv_heads, head_dim, head_dim]`` otherwise ("V2", every head of the
  model; OSCAR slices each tensor-parallel rank's heads out of it);
- the K file carries ``k_mean`` (``[num_kv_heads, head_dim]``, subtracted before the rotation) when
  the artifact has key means;
- rows are rotated as ``x @ R`` (OSCAR's ``_rotate_heads``), the same convention as rotkv
  (``k' = (k - mu) @ R_K``, ``v' = v @ R_V``, output ``o' @ R_V^T``): no transposition.

OSCAR takes one clip ratio for all keys and one for all values (``SGLANG_OSCAR_K_CLIP_RATIO``,
``SGLANG_OSCAR_V_CLIP_RATIO``; threshold ``sorted(|row|)[int(c * head_dim)]``, rotkv's rule), so
per-layer ratios are written to ``oscar.env`` as their mean, with the per-layer values in
``rotkv_export.json``. Only tensors, numbers, strings and dicts are saved, so the files load with
``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import json
import os

import torch

from rotkv.rotations.artifact import Artifact, load_artifact

K_FILE = "k_rotation_qqt_r_h_pbr.pt"  # OSCAR's K_ROTATION_FILENAME
V_FILE = "v_rotation_sst_r_h_pbr.pt"  # OSCAR's V_ROTATION_FILENAME
ENV_FILE = "oscar.env"
INFO_FILE = "rotkv_export.json"
SHARED_TOL = 1e-6  # heads whose matrices differ by less than this are written as one shared matrix


def _layer_matrix(art: Artifact, name: str, layer: int, heads: int, d: int) -> torch.Tensor:
    """``[D, D]`` if every head shares one matrix, else ``[H, D, D]`` (float32)."""
    t = art.tensors.get(f"{name}.{layer}")
    if t is None:  # values not rotated: identity
        return torch.eye(d, dtype=torch.float32)
    t = t.float()
    if t.shape[0] == 1 or (t - t[:1]).abs().max().item() <= SHARED_TOL:
        return t[0].contiguous()
    if t.shape[0] != heads:
        raise ValueError(f"artifact tensor {name}.{layer} has {t.shape[0]} heads, the metadata says {heads}")
    return t.contiguous()


def oscar_states(art: Artifact) -> tuple[dict, dict]:
    """The K and V checkpoint dicts for an artifact."""
    if art.values_folded:
        raise ValueError(f"artifact {art.path}: R_V is folded into the model's weights (values_folded=1); "
                         "OSCAR rotates values at run time, so export an artifact made without folding")
    layers, heads, d = art.num_layers, int(art.meta["kv_heads"]), int(art.meta["head_dim"])
    calib = {
        "source": "rotkv",
        "method": art.meta.get("method", ""),
        "model_path": art.meta.get("model_id", ""),
        "model_revision": None,
        "weights_fingerprint": art.meta.get("weights_fingerprint", ""),
        "global_kv_heads": heads,
        "head_dim": d,
        "bits": art.meta.get("bits", ""),
        "group_size": art.meta.get("group_size", ""),
        "tokens": art.meta.get("calib_tokens", ""),
        "post_rope": True,
        "rotkv_format_version": art.meta.get("format_version", "1"),
    }
    if any(name.startswith("k_scale") for name in art.tensors):
        raise ValueError(f"artifact {art.path} has a key scaling (k_scale): OSCAR's runtime reads one orthogonal R_K per "
                         "layer, so it cannot serve it; export an artifact calibrated without --key-scale")
    k_layers, v_layers = {}, {}
    for l in range(layers):
        rk = _layer_matrix(art, "R_K", l, heads, d)
        k_layers[l] = {"layer_id": l, "rotation": rk}
        mean = art.tensors.get(f"k_mean.{l}")
        if mean is not None:
            k_layers[l]["k_mean"] = mean.float().contiguous()
        v_layers[l] = {"layer_id": l, "rotation": _layer_matrix(art, "R_V", l, heads, d)}

    def grouping(ls: dict) -> str:
        return "head" if any(e["rotation"].dim() == 3 for e in ls.values()) else "layer"

    k_state = {"format_version": 1, "objective": "qqt_r_h_pbr", "source_grouping": grouping(k_layers),
               "calibration": dict(calib), "layers": k_layers}
    v_state = {"format_version": 1, "objective": "sst_r_h_pbr", "source_grouping": grouping(v_layers),
               "calibration": dict(calib), "layers": v_layers}
    return k_state, v_state


def _clip(art: Artifact, name: str) -> list[float] | None:
    t = art.tensors.get(name)
    return None if t is None else [float(x) for x in t.tolist()]


def export_oscar(artifact: str | Artifact, out_dir: str) -> dict[str, str]:
    """Write the OSCAR K/V checkpoints, ``oscar.env`` and ``rotkv_export.json`` into ``out_dir``; return their paths."""
    art = load_artifact(artifact) if isinstance(artifact, str) else artifact
    k_state, v_state = oscar_states(art)
    os.makedirs(out_dir, exist_ok=True)
    paths = {"k": os.path.join(out_dir, K_FILE), "v": os.path.join(out_dir, V_FILE),
             "env": os.path.join(out_dir, ENV_FILE), "info": os.path.join(out_dir, INFO_FILE)}
    for key, state in (("k", k_state), ("v", v_state)):
        tmp = paths[key] + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, paths[key])
    clips = {"k": _clip(art, "clip_k"), "v": _clip(art, "clip_v")}
    mean = {k: (sum(v) / len(v) if v else None) for k, v in clips.items()}
    lines = ["# OSCAR (SGLang) settings for this export; source it before launching with --kv-cache-dtype int2",
             f"SGLANG_OSCAR_K_ROTATION_PATH={os.path.abspath(paths['k'])}",
             f"SGLANG_OSCAR_V_ROTATION_PATH={os.path.abspath(paths['v'])}"]
    for k in ("k", "v"):
        if mean[k] is not None:
            spread = max(clips[k]) - min(clips[k])
            note = "" if spread == 0 else f"  # mean of rotkv's per-layer ratios ({min(clips[k]):.4f}..{max(clips[k]):.4f})"
            lines.append(f"SGLANG_OSCAR_{k.upper()}_CLIP_RATIO={mean[k]:.4f}{note}")
    if art.meta.get("group_size", "").strip().isdigit():
        lines.append(f"# launch flag: --kv-cache-quant-group-size {art.meta['group_size']}")
    with open(paths["env"], "w") as f:
        f.write("\n".join(lines) + "\n")
    info = {"artifact": os.path.abspath(art.path) if art.path else None, "meta": dict(art.meta),
            "k_file": K_FILE, "v_file": V_FILE, "clip_k": clips["k"], "clip_v": clips["v"],
            "clip_k_env": mean["k"], "clip_v_env": mean["v"],
            "k_grouping": k_state["source_grouping"], "v_grouping": v_state["source_grouping"],
            "k_mean": any("k_mean" in e for e in k_state["layers"].values())}
    with open(paths["info"], "w") as f:
        json.dump(info, f, indent=2, sort_keys=True)
    return paths
