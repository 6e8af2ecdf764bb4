"""Start-up time of the commands and processes that must not load Lightning (or torch) to do their job.

Each command runs ``--repeats`` times in a fresh interpreter; the table gives the median wall time, and which
heavy modules the import left in ``sys.modules``.

    python benchmarks/import_time.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

PROBE = "import sys; {code}; print(*(m for m in ('torch', 'lightning') if m in sys.modules))"

COMMANDS = {
    "oobleck plan --help": [str(Path(sys.executable).with_name("oobleck")), "plan", "--help"],
    "import lightning_oobleck": [sys.executable, "-c", PROBE.format(code="import lightning_oobleck")],
    "coordinator (python -m lightning_oobleck.recovery --help)": [
        sys.executable, "-m", "lightning_oobleck.recovery", "--help"
    ],
    "SLURM rendezvous module": [
        sys.executable, "-c", PROBE.format(code="import lightning_oobleck.slurm.rendezvous")
    ],
    "for comparison: import lightning": [sys.executable, "-c", PROBE.format(code="import lightning")],
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    table = Table(title=f"Start-up time, median of {args.repeats} fresh interpreters")
    for column in ("command", "seconds", "heavy modules loaded"):
        table.add_column(column, justify="right" if column == "seconds" else "left")
    for name, command in COMMANDS.items():
        times, loaded = [], ""
        for _ in range(args.repeats):
            start = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            times.append(time.perf_counter() - start)
            loaded = done.stdout.strip() if "-c" in command else "-"
        table.add_row(name, f"{statistics.median(times):.2f}", loaded or "none")
    Console().print(table)


if __name__ == "__main__":
    main()
