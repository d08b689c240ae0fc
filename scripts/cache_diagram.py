"""The README's picture: how one layer of a rotkv cache holds a row's tokens (docs/cache_layout.png).

    .venv/bin/python scripts/cache_diagram.py [--out docs/cache_layout.png]
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

# (label, first x, width, colour) of each tier along the row's tokens, oldest on the left
TIERS = [
    ("bf16 sink\n(first S tokens)", 0.0, 1.2, "#9ecae1"),
    ("INT2 body: pages of P tokens\nrotated, per-token groups, clipped", 1.3, 5.0, "#fdae6b"),
    ("refine pages\n(+2 bits, newest body)", 6.4, 1.6, "#fd8d3c"),
    ("bf16 window\n(last W tokens)", 8.1, 1.9, "#9ecae1"),
]


def draw(out: str) -> None:
    fig, ax = plt.subplots(figsize=(10, 2.9))
    y, h = 0.0, 1.0
    for label, x, w, colour in TIERS:
        ax.add_patch(Rectangle((x, y), w, h, facecolor=colour, edgecolor="black", linewidth=1))
        ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=9)
    for i in range(1, 10):  # page boundaries inside the body
        x = 1.3 + i * 0.5
        for y0, y1 in ((y, y + 0.22), (y + h - 0.22, y + h)):  # ticks clear of the label
            ax.plot([x, x], [y0, y1], color="black", linewidth=0.6)
    ax.text(5.0, 2.05, "post-RoPE K, V  \u2192  k' = (k \u2212 \u03bc)\u00b7R_K,  v' = v\u00b7R_V  \u2192  stored tiers; "
            "queries rotated the same way: q' = q\u00b7R_K", ha="center", va="center", fontsize=10)
    ax.add_patch(FancyArrowPatch((5.0, 1.85), (5.0, 1.08), arrowstyle="->", mutation_scale=14))
    ax.annotate("", xy=(10.0, -0.25), xytext=(0.0, -0.25), arrowprops=dict(arrowstyle="->", linewidth=0.8))
    ax.text(5.0, -0.45, "a row's tokens, oldest to newest: tokens leave the window in pages and are quantized",
            ha="center", va="center", fontsize=9)
    ax.set_xlim(-0.1, 10.1)
    ax.set_ylim(-0.65, 2.3)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/cache_layout.png")
    draw(ap.parse_args(argv).out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
