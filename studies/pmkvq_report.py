"""Markdown tables (and a plot) from pmkvq_equal_memory.py's JSON.

    python studies/pmkvq_report.py studies/results/pmkvq/pmkvq_equal_memory.json [--plot studies/results/pmkvq/pmkvq_bpe.png]
"""

from __future__ import annotations

import argparse
import json


def table(res: dict, cfg: dict) -> str:
    rows = ["| method | NLL | ΔNLL vs exact | KL(exact‖method) | kept tokens at end | peak KV MB | budget MB | bits/elem of context at end | seconds |",
            "|---|---|---|---|---|---|---|---|---|"]
    ref = res["ref"]["nll"]
    for name, r in res.items():
        if name == "ref":
            continue
        last = r["trace"][-1]
        rows.append(f"| {name} | {r['nll']:.4f} | {r['nll'] - ref:+.4f} | {r['kl']:.4f} | {last['stored_tokens']} / {last['context']} | "
                    f"{r['peak_kv_bytes'] / 1e6:.2f} | {r['budget_bytes'] / 1e6:.2f} | {r['final_bpe']:.2f} | {r['seconds']:.0f} |")
    rows.append(f"| exact (fp32 cache, no budget) | {ref:.4f} | 0 | 0 | all | | | 32 | |")
    return "\n".join(rows)


def over_time(res: dict, points: int = 6) -> str:
    names = [n for n in res if n != "ref"]
    trace0 = res[names[0]]["trace"]
    idx = sorted({round(i * (len(trace0) - 1) / (points - 1)) for i in range(points)})
    head = "| context | " + " | ".join(names) + " |"
    rows = [head, "|" + "---|" * (len(names) + 1)]
    for i in idx:
        cells = []
        for n in names:
            t = res[n]["trace"][i]
            w = f" ({'/'.join(map(str, t['widths']))})" if t["widths"] else ""
            cells.append(f"{t['bits_per_context_element']:.2f}{w}")
        rows.append(f"| {trace0[i]['context']} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for n, r in res.items():
        if n == "ref":
            continue
        ax.plot([t["context"] for t in r["trace"]], [t["bits_per_context_element"] for t in r["trace"]], label=n)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("KV bits per element of the context")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("json")
    p.add_argument("--plot", default=None)
    a = p.parse_args()
    d = json.load(open(a.json))
    print(table(d["results"], d["config"]))
    print()
    print(over_time(d["results"]))
    if a.plot:
        plot(d["results"], a.plot)


if __name__ == "__main__":
    main()
