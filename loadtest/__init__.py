"""Load testing, calibration and the simulated engine for the gateway."""

__version__ = "0.1.0"
