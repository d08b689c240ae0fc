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


def run(args) -> int:
    if not os.path.exists(args.artifact):
        raise UsageError(f"--artifact {args.artifact}: no such file")
    if os.path.isdir(args.artifact):
        raise UsageError(f"--artifact {args.artifact} is a directory, not a file")
    check_out_dir(args.out)
    from rotkv.integrations.oscar_export import export_oscar

    paths = export_oscar(args.artifact, args.out)
    print(f"wrote {paths['k']}")
    print(f"wrote {paths['v']}")
    print(f"wrote {paths['env']} (source it: the OSCAR paths and clip ratios)")
    print(f"wrote {paths['info']}")
    return 0
