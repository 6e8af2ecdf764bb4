"""``oobleck consolidate``: a sharded checkpoint as one plain Lightning checkpoint file."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "consolidate",
        help="turn a sharded checkpoint into one Lightning checkpoint file (weights, for any strategy)",
        description=(
            "Write the weights of a sharded checkpoint (a directory written with strategy='oobleck') and "
            "Lightning's entries as one checkpoint file that loads with any strategy: "
            "MyModel.load_from_checkpoint(OUTPUT), trainer.validate(model, ckpt_path=OUTPUT). It holds no "
            "optimizer state: resume training from the sharded checkpoint."
        ),
    )
    parser.add_argument(
        "checkpoint", help="the sharded checkpoint directory (e.g. .../epoch=0-step=100.ckpt)"
    )
    parser.add_argument("output", help="the checkpoint file to write (e.g. model.ckpt)")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from lightning_oobleck.execution.checkpoint import consolidate_checkpoint

    written = consolidate_checkpoint(args.checkpoint, args.output)
    print(f"wrote {written}")
    return 0
