"""`rotkv export --format oscar --artifact A --out DIR`: write a calibration in another engine's layout."""

from __future__ import annotations

import os

from rotkv.cli.errors import UsageError

FORMATS = ("oscar",)


def register(sub) -> None:
    p = sub.add_parser("export", help="write an artifact's rotations in another engine's layout (OSCAR/SGLang)")
    p.add_argument("--format", required=True, choices=FORMATS,
                   help="oscar: the K/V rotation checkpoints OSCAR's SGLang integration loads (docs/serving-engines.md)")
    p.add_argument("--artifact", required=True, help="a rotkv artifact (rotkv calibrate --out ...)")
    p.add_argument("--out", required=True, help="output folder (created if missing)")
    p.set_defaults(func=run)


def check_out_dir(path: str) -> None:
    if not path:
        raise UsageError("--out is empty")
    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        raise UsageError(f"--out {path} is a file; pass a folder")
    parent = full
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UsageError(f"--out {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--out {path}: the folder {parent} is not writable")


def check_exportable(art, path: str) -> None:
    """OSCAR's format is K/V rotations (and clip ratios): refuse an artifact without rotations (a
    ``pmkvq`` artifact holds per-layer widths only, which would be written as identity rotations),
    and say what is left out of one whose widths OSCAR does not read."""
    method = art.meta.get("method", "?")
    if not any(k.startswith(("R_K.", "R_V.")) for k in art.tensors):
        raise UsageError(f"--artifact {path} (method {method!r}) holds no rotations, only per-layer widths; OSCAR's "
                         "format is rotations: export the artifact it was fitted on (its --base-artifact) instead")
    dropped = [k for k in ("bits", "k_bits") if k in art.tensors]
    if dropped:
        from rotkv.cli.errors import warn

        warn("export", f"{path} (method {method!r}): OSCAR reads rotations and clip ratios only; its per-layer "
                       f"widths ({', '.join(dropped)}) are not exported")


def run(args) -> int:
    if not os.path.exists(args.artifact):
        raise UsageError(f"--artifact {args.artifact}: no such file")
    if os.path.isdir(args.artifact):
        raise UsageError(f"--artifact {args.artifact} is a directory, not a file")
    check_out_dir(args.out)
    from rotkv.integrations.oscar_export import export_oscar
    from rotkv.rotations.artifact import load_artifact

    art = load_artifact(args.artifact)
    check_exportable(art, args.artifact)
    paths = export_oscar(art, args.out)
    print(f"wrote {paths['k']}")
    print(f"wrote {paths['v']}")
    print(f"wrote {paths['env']} (source it: the OSCAR paths and clip ratios)")
    print(f"wrote {paths['info']}")
    return 0
