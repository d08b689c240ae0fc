"""Plots of results.json (matplotlib, Agg): NIAH heatmaps, KL / NIAH accuracy against measured bits, attention error per layer."""

from __future__ import annotations

import math
import os
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PEER_MARK = "s"
ROTKV_MARK = "o"


def _method_order(records: list[dict]) -> list[str]:
    seen = []
    for r in records:
        if r["method"] not in seen and r["method"] != "plain-fp32":
            seen.append(r["method"])
    return seen


def heatmap_variant(records: list[dict]) -> str | None:
    """The variant with the most (depth, length) cells; ties go to essay, then multikey, then noise."""
    cells: dict[str, set] = {}
    for r in records:
        if r["task"] == "niah" and r["depth"] is not None:
            cells.setdefault(r["variant"], set()).add((r["depth"], r["length"]))
    if not cells:
        return None
    rank = {"essay": 0, "multikey": 1, "noise": 2}
    return min(cells, key=lambda v: (-len(cells[v]), rank.get(v, 9)))


def _grid(records, method, variant):
    cells = {(r["depth"], r["length"]): r for r in records
             if r["task"] == "niah" and r["method"] == method and r["variant"] == variant and r["depth"] is not None}
    depths = sorted({d for d, _ in cells})
    lengths = sorted({L for _, L in cells})
    return cells, depths, lengths


def _draw_heatmap(ax, records, method, variant) -> bool:
    cells, depths, lengths = _grid(records, method, variant)
    if not cells:
        return False
    data = [[cells[(d, L)]["accuracy"] if (d, L) in cells else math.nan for L in lengths] for d in depths]
    ax.imshow(data, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), [f"{L // 1024}K" if L % 1024 == 0 else str(L) for L in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    for i, d in enumerate(depths):
        for j, L in enumerate(lengths):
            r = cells.get((d, L))
            if r is None:
                continue
            mark = {"sink": " S", "window": " W"}.get(r["bf16_tier"], "")
            ax.text(j, i, f"{r['accuracy']:.2f}{mark}\nn={r['n']}", ha="center", va="center", fontsize=7)
    bpe = sum(cells[k]["bpe_measured"] for k in cells) / len(cells)
    ax.set_title(f"{method}\n{bpe:.2f} bits/elem measured", fontsize=9)
    ax.set_xlabel("context")
    ax.set_ylabel("needle depth")
    return True


def plot_heatmaps(records: list[dict], out_dir: str) -> list[str]:
    """One heatmap per method (depth x length, the essay variant) and a grid of all of them."""
    variant = heatmap_variant(records)
    if variant is None:
        return []
    paths = []
    methods = _method_order([r for r in records if r["task"] == "niah"])
    for m in methods:
        fig, ax = plt.subplots(figsize=(3.6, 3.0))
        if _draw_heatmap(ax, records, m, variant):
            fig.suptitle(f"NIAH ({variant}), greedy exact match; S/W: needle in the bf16 sink/window", fontsize=7)
            fig.tight_layout()
            p = os.path.join(out_dir, f"niah_heatmap_{m}.png")
            fig.savefig(p, dpi=110)
            paths.append(p)
        plt.close(fig)
    cols = min(4, len(methods))
    rows = math.ceil(len(methods) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.3 * cols, 2.9 * rows), squeeze=False)
    for ax, m in zip(axes.flat, methods):
        _draw_heatmap(ax, records, m, variant)
    for ax in list(axes.flat)[len(methods):]:
        ax.axis("off")
    fig.suptitle(f"NIAH ({variant} haystack): accuracy by needle depth and context length", fontsize=10)
    fig.tight_layout()
    p = os.path.join(out_dir, "niah_heatmaps.png")
    fig.savefig(p, dpi=100)
    plt.close(fig)
    return paths + [p]


def _pareto(ax, points, ylabel, logy=False):
    for method, (x, y, peer) in points.items():
        ax.scatter([x], [y], marker=PEER_MARK if peer else ROTKV_MARK, s=40)
        ax.annotate(method, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("measured bits per element (all tiers and metadata)")
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)


def plot_pareto(records: list[dict], out_dir: str, peers: set[str]) -> list[str]:
    paths = []
    nll_lengths = sorted({r["length"] for r in records if r["task"] == "nll" and r["method"] != "plain-fp32"})
    if nll_lengths:
        fig, axes = plt.subplots(1, len(nll_lengths), figsize=(5 * len(nll_lengths), 4), squeeze=False)
        for ax, L in zip(axes[0], nll_lengths):
            pts = {r["method"]: (r["bpe_measured"], max(r["kl"], 1e-6), r["method"] in peers) for r in records
                   if r["task"] == "nll" and r["length"] == L and "kl" in r}
            _pareto(ax, pts, "KL(plain model || method), nats/token", logy=True)
            ax.set_title(f"decode after {L} tokens of context", fontsize=9)
        fig.tight_layout()
        p = os.path.join(out_dir, "pareto_kl.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    agg = defaultdict(lambda: [0.0, 0, 0.0])
    for r in records:
        if r["task"] == "niah":
            a = agg[r["method"]]
            a[0] += r["accuracy"] * r["n"]
            a[1] += r["n"]
            a[2] += r["bpe_measured"] * r["n"]
    if agg:
        fig, ax = plt.subplots(figsize=(5.5, 4))
        pts = {m: (a[2] / a[1], a[0] / a[1], m in peers) for m, a in agg.items() if a[1]}
        _pareto(ax, pts, "NIAH accuracy (all variants, lengths, depths)")
        ax.set_ylim(-0.05, 1.05)
        fig.tight_layout()
        p = os.path.join(out_dir, "pareto_niah.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def plot_attn(records: list[dict], out_dir: str) -> list[str]:
    recs = [r for r in records if r["task"] == "attn-error"]
    if not recs:
        return []
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in recs:
        ax.plot(r["rel_error_per_layer"], marker=".", label=f"{r['method']} ({r['bpe_measured']:.2f} b)")
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("relative error of attention output after W_O")
    ax.set_title(f"per-layer attention error, context {recs[0]['length']} (layers isolated)", fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    p = os.path.join(out_dir, "attn_error_layers.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return [p]
