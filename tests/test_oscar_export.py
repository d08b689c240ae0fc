"""`rotkv export --format oscar`: the files are read back by a re-implementation of OSCAR's loader.

The reader below follows github.com/FutureMLS-Lab/OSCAR python/sglang/srt/mem_cache/memory_pool.py
(``load_oscar_rotations``, ``load_oscar_rotation_field``, ``_shard_rotation_heads``) and the
orthogonality check of oscar_calibration.py (``_validate_checkpoint``, tolerance 5e-3)."""

import json
import os

import pytest
import torch

from rotkv.cli import main
from rotkv.integrations.oscar_export import K_FILE, V_FILE, export_oscar
from rotkv.rotations.artifact import load_artifact
from rotkv.rotations.identity import random_orthogonal
from rotkv_testing import write_artifact


def oscar_load(path, layer_num, head_dim, field="rotation", vector=False):
    """OSCAR's loader logic: ``{"layers": {id: {field: T}}}``, int or str ids, [hd, hd] or [H, hd, hd]."""
    state = torch.load(path, map_location="cpu", weights_only=True)  # the files hold no pickled objects
    assert "layers" in state
    layers, mats = state["layers"], []
    for lid in range(layer_num):
        assert lid in layers or str(lid) in layers, f"missing layer {lid}"
        t = layers.get(lid, layers.get(str(lid))).get(field)
        if t is None:
            mats.append(None)
            continue
        tail = (head_dim,) if vector else (head_dim, head_dim)
        assert tuple(t.shape[-len(tail):]) == tail and t.dim() in (len(tail), len(tail) + 1)
        mats.append(t.to(torch.float32))
    if all(m is None for m in mats):
        return None
    assert all(m is not None for m in mats), f"{field} on some layers only"
    return torch.stack(mats)


def shard_heads(R, local_heads, rank):
    """OSCAR's _shard_rotation_heads for a stacked [L, H, hd, hd] (no replication)."""
    if R.dim() == 4 and R.shape[1] != local_heads:
        return R[:, rank * local_heads:(rank + 1) * local_heads]
    return R


def check_orthogonal(R):
    eye = torch.eye(R.shape[-1])
    assert (R @ R.transpose(-1, -2) - eye).abs().max().item() < 5e-3


def test_per_head_artifact_round_trips(tiny_llama, tmp_path):
    path = write_artifact(tiny_llama, tmp_path / "a.safetensors")
    paths = export_oscar(path, str(tmp_path / "out"))
    art = load_artifact(path)
    rk = oscar_load(paths["k"], 2, 16)
    rv = oscar_load(paths["v"], 2, 16)
    mean = oscar_load(paths["k"], 2, 16, "k_mean", vector=True)
    assert rk.shape == (2, 2, 16, 16) and rv.shape == (2, 2, 16, 16) and mean.shape == (2, 2, 16)
    assert oscar_load(paths["v"], 2, 16, "k_mean", vector=True) is None
    check_orthogonal(rk)
    check_orthogonal(rv)
    for l in range(2):
        assert torch.equal(rk[l], art.tensors[f"R_K.{l}"].float())
        assert torch.equal(rv[l], art.tensors[f"R_V.{l}"].float())
        assert torch.equal(mean[l], art.tensors[f"k_mean.{l}"].float())
        # OSCAR rotates rows as (k - mean) @ R per head; rotkv's LayerRotation does the same
        rot = art.layer_rotation(l)
        k = torch.randn(5, 2, 16)
        oscar = torch.einsum("thd,hde->the", k - mean[l], rk[l])
        ours = rot.keys(k.transpose(0, 1)).transpose(0, 1)  # keys() subtracts the mean itself
        assert torch.allclose(oscar, ours, atol=1e-5)
    # tensor parallelism over 2 ranks: rank r gets KV head r's matrices
    for rank in range(2):
        assert torch.equal(shard_heads(rk, 1, rank)[:, 0], rk[:, rank])
    state = torch.load(paths["k"], weights_only=True)
    assert state["format_version"] == 1 and state["source_grouping"] == "head" and state["calibration"]["post_rope"]
    env = open(paths["env"]).read()
    assert f"SGLANG_OSCAR_K_ROTATION_PATH={os.path.abspath(paths['k'])}" in env
    assert "SGLANG_OSCAR_K_CLIP_RATIO=0.9500" in env and "SGLANG_OSCAR_V_CLIP_RATIO=0.9100" in env
    info = json.load(open(paths["info"]))
    assert info["clip_k"] == pytest.approx([0.96, 0.94]) and info["k_mean"] is True


def test_shared_matrices_are_written_per_layer(tiny_llama, tmp_path):
    shared = {f"R_K.{l}": random_orthogonal(16, l)[None] for l in range(2)}
    shared |= {f"R_V.{l}": random_orthogonal(16, 7 + l).expand(2, 16, 16).contiguous() for l in range(2)}
    path = write_artifact(tiny_llama, tmp_path / "s.safetensors", tensors=shared)
    paths = export_oscar(path, str(tmp_path / "out"))
    rk, rv = oscar_load(paths["k"], 2, 16), oscar_load(paths["v"], 2, 16)
    assert rk.shape == (2, 16, 16) and rv.shape == (2, 16, 16)  # OSCAR's "V1": one matrix per layer
    assert torch.equal(rk[1], shared["R_K.1"][0]) and torch.equal(rv[0], shared["R_V.0"][0])
    assert torch.load(paths["k"], weights_only=True)["source_grouping"] == "layer"
    assert shard_heads(rk, 1, 1) is rk  # shared rotations pass through TP slicing


def test_cli_export(tiny_llama, tmp_path, capsys):
    path = write_artifact(tiny_llama, tmp_path / "a.safetensors")
    assert main(["export", "--format", "oscar", "--artifact", path, "--out", str(tmp_path / "o")]) == 0
    assert sorted(os.listdir(tmp_path / "o")) == sorted([K_FILE, V_FILE, "oscar.env", "rotkv_export.json"])


@pytest.mark.parametrize("case", ["missing", "not-an-artifact", "out-is-file", "folded"])
def test_cli_export_errors(tiny_llama, tmp_path, capsys, case):
    art = write_artifact(tiny_llama, tmp_path / "a.safetensors", values_folded="1" if case == "folded" else "0")
    out = str(tmp_path / "o")
    if case == "missing":
        art = str(tmp_path / "nope.safetensors")
    elif case == "not-an-artifact":
        art = str(tmp_path / "junk.safetensors")
        open(art, "w").write("junk")
    elif case == "out-is-file":
        open(out, "w").write("x")
    assert main(["export", "--format", "oscar", "--artifact", art, "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rotkv export: error:") and err.count("\n") == 1


def test_cli_export_bad_format(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["export", "--format", "gguf", "--artifact", "a", "--out", str(tmp_path)])
    assert e.value.code == 2
