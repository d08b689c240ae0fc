"""Calibration: capture post-RoPE statistics, fit OSCAR / OptR / pairwise rotations, key means, clips."""

from rotkv.calibrate.run import METHODS, CalibConfig, calibrate

__all__ = ["METHODS", "CalibConfig", "calibrate"]
