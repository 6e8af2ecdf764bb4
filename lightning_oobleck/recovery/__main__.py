"""``python -m lightning_oobleck.recovery --world-size N``: a coordinator of its own, for a launcher of yours
(the local launcher starts one this way), or ``--follow ADDRESS``: the standby of the active one (a worker
starts it when asked); see :func:`lightning_oobleck.recovery.coordinator.main`."""

from lightning_oobleck.recovery.coordinator import main

raise SystemExit(main())
