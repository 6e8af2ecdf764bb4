"""``python -m lightning_oobleck.recovery --world-size N``: the recovery coordinator (SLURM batch host)."""

from lightning_oobleck.recovery.coordinator import main

raise SystemExit(main())
