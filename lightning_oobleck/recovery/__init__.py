"""Failure detection, membership agreement and fencing (coordinator + worker agent), and recovery events."""

from lightning_oobleck.recovery.agent import (
    AgreementTimeout,
    CoordinatorLost,
    CoordinatorUnreachable,
    GenerationChanged,
    RecoveryError,
    RegistrationRefused,
    WorkerAgent,
)
from lightning_oobleck.recovery.coordinator import Coordinator, Death
from lightning_oobleck.recovery.events import PHASES, EventLog, RecoveryEvent, read_events
from lightning_oobleck.recovery.protocol import ADDRESS_ENV, FENCED_EXIT_CODE, Membership
from lightning_oobleck.worker import Worker

__all__ = [
    "ADDRESS_ENV",
    "FENCED_EXIT_CODE",
    "PHASES",
    "AgreementTimeout",
    "Coordinator",
    "CoordinatorLost",
    "CoordinatorUnreachable",
    "Death",
    "EventLog",
    "GenerationChanged",
    "Membership",
    "RecoveryError",
    "RecoveryEvent",
    "RegistrationRefused",
    "Worker",
    "WorkerAgent",
    "read_events",
]
