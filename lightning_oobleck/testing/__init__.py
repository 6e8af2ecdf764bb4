"""Utilities for tests, benchmarks and drills: emulated devices (pipelines on machines without the devices
they model), the named fault points (make a worker crash, hang, fail or slow down at a chosen moment), and
the bytes of live tensors on the CPU (memory checks that run the code a GPU runs), and a process's peak
resident memory over a block."""

from lightning_oobleck.execution.faults import (
    FAULTS_ENV,
    Fault,
    FaultAction,
    FaultPoint,
    FaultTarget,
    arm,
    armed,
    disarm,
)
from lightning_oobleck.execution.memory import LiveTensorMeter
from lightning_oobleck.testing.emulated import (
    DeviceTimes,
    EmulatedLayer,
    EmulatedSplitLayer,
    emulated_layers,
    emulated_profile,
)
from lightning_oobleck.testing.memory import PeakResidentMemory

__all__ = [
    "FAULTS_ENV",
    "DeviceTimes",
    "EmulatedLayer",
    "EmulatedSplitLayer",
    "Fault",
    "FaultAction",
    "FaultPoint",
    "FaultTarget",
    "LiveTensorMeter",
    "PeakResidentMemory",
    "arm",
    "armed",
    "disarm",
    "emulated_layers",
    "emulated_profile",
]
