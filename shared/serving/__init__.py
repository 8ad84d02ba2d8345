"""The serving controller's pure core (``core.py``): warm-runtime pools decided cluster-wide."""

from shared.serving.core import Grant, HostReport, ServingConfig, ServingCore

__all__ = ["Grant", "HostReport", "ServingConfig", "ServingCore"]
