"""Rotations of post-RoPE keys and values: identity, Hadamard, random, and calibrated artifacts."""

from rotkv.rotations.base import LayerRotation, build_rotations, hadamard_matrix, random_orthogonal

__all__ = ["LayerRotation", "build_rotations", "hadamard_matrix", "random_orthogonal"]
