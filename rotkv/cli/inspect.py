"""`rotkv inspect FILE`: print an artifact's metadata and tensors; optionally check it (``--check``),
against a preset's contract (``--preset``) and against a model (``--model``)."""

from __future__ import annotations

from rotkv.cli.errors import UsageError
from rotkv.config import PRESETS


def register(sub) -> None:
    p = sub.add_parser("inspect", help="print a summary of a rotkv artifact")
    p.add_argument("file")
    p.add_argument("--model", default=None, help="also check the artifact against this model")
    p.add_argument("--check", action="store_true",
                   help="check the contract fields (kind, method, bits, group_size), that every rotation is "
                        "orthogonal and that every value is finite")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS),
                   help="also check the artifact against this preset: the kind of artifact it reads, its bits and "
                        "group size")
    p.set_defaults(func=run)


def check_report(art, preset: str | None = None) -> list[str]:
    """Print one line per check; return the problems found (empty: the artifact is sound)."""
    from rotkv.contract import CONTRACT_META, contract_diffs
    from rotkv.rotations.artifact import ORTHO_TOL, orthogonality_error, value_problems

    problems = []
    missing = [k for k in CONTRACT_META if k not in art.meta and k != "kind"]  # a missing kind is inferred
    recorded = ", ".join(f"{k} {art.meta[k]}" for k in CONTRACT_META if k in art.meta)
    if art.kind_inferred:
        recorded = f"kind {art.kind} (inferred), " + recorded
    print(f"  contract fields: {recorded or 'none'}" + (f"; missing {missing}" if missing else ""))
    if missing:
        problems.append(f"the contract fields {missing} are not recorded")
    err = orthogonality_error(art)
    if err:
        print(f"  max |R^T R - I| over {len(err)} rotation(s): {max(err.values()):.2e} (tolerance {ORTHO_TOL:g})")
    found = value_problems(art)
    print("  values: " + ("all finite, rotations orthogonal" if not found else "; ".join(found)))
    problems += found
    if preset is not None:
        diffs = contract_diffs(art, PRESETS[preset])
        print(f"  preset {preset}: " + ("matches" if not diffs else "; ".join(diffs)))
        problems += [f"preset {preset}: {d}" for d in diffs]
    return problems


def run(args) -> int:
    from rotkv.contract import validate_artifact
    from rotkv.rotations.artifact import load_artifact

    preset = getattr(args, "preset", None)
    art = load_artifact(args.file, check=not (args.check or preset))  # --check reports every problem
    print(art.summary())
    if args.check or preset:
        problems = check_report(art, preset)
        if problems:
            raise UsageError(f"artifact {args.file} is {art.describe()} and failed {len(problems)} check(s): " + "; ".join(problems))
        print("  check: ok")
    if args.model:
        from rotkv.hf.models import load_model

        validate_artifact(art, load_model(args.model, device="cpu").model, PRESETS[preset] if preset else None)
        print(f"  matches model {args.model}")
    return 0
