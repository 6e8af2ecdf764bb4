"""``python -m lightning_oobleck.recovery --world-size N``: a recovery coordinator of its own, for a launcher
of yours (see :func:`lightning_oobleck.recovery.coordinator.main`)."""

from lightning_oobleck.recovery.coordinator import main

raise SystemExit(main())
