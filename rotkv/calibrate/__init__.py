"""Calibration: capture post-RoPE statistics, fit the registered methods' rotations (rotkv.rotations.registry),
key means, clips."""

from rotkv.calibrate.run import CalibConfig, calibrate

__all__ = ["CalibConfig", "calibrate"]
