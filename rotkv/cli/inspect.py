"""`rotkv inspect FILE`: print an artifact's metadata and tensors; optionally check it against a model."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("inspect", help="print a summary of a rotkv artifact")
    p.add_argument("file")
    p.add_argument("--model", default=None, help="also check the artifact against this model")
    p.add_argument("--check", action="store_true", help="check orthogonality of every rotation")
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    from rotkv.rotations.artifact import load_artifact, validate_artifact

    art = load_artifact(args.file)
    print(art.summary())
    if args.check:
        worst = 0.0
        for name, t in art.tensors.items():
            if name.startswith(("R_K.", "R_V.")):
                eye = torch.eye(t.shape[-1])
                worst = max(worst, (t.float().transpose(-1, -2) @ t.float() - eye).abs().max().item())
        print(f"  max |R^T R - I| over all rotations: {worst:.2e}")
    if args.model:
        from rotkv.hf.models import load_model

        validate_artifact(art, load_model(args.model, device="cpu").model)
        print(f"  matches model {args.model}")
    return 0
