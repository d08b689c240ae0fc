"""Rotations of post-RoPE keys and values: one file per method, one registry (rotkv.rotations.registry).

The names below are imported on first use, so ``from rotkv.rotations import registry`` (the command
line's method lists) does not import torch.
"""

_HOMES = {
    "LayerRotation": "rotkv.rotations.base",
    "hadamard_matrix": "rotkv.rotations.hadamard",
    "random_orthogonal": "rotkv.rotations.identity",
    "build_rotations": "rotkv.rotations.registry",
    "METHODS": "rotkv.rotations.registry",
    "RotationMethod": "rotkv.rotations.registry",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'rotkv.rotations' has no attribute {name!r}")
