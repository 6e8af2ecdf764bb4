"""Utilities for tests and benchmarks of pipelines on machines without the devices they model."""

from lightning_oobleck.testing.emulated import DeviceTimes, EmulatedLayer, emulated_layers, emulated_profile

__all__ = ["DeviceTimes", "EmulatedLayer", "emulated_layers", "emulated_profile"]
