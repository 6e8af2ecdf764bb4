"""What to submit to SLURM and how: :class:`SubmitConfig`, the ``submit:`` section of a training config.

A YAML file such as::

    submit:
      nodes: 4
      gpus_per_node: 8
      time: "12:00:00"
      script: examples/gpt/train.py
      args: [--config, examples/gpt/config.yaml]

is read with :func:`load_submit_config` and overridden from the command line with dot-lists
(``submit.nodes=2``); the file's other sections belong to the training script. Unknown keys, a missing time
limit and malformed values are errors that name the key and the fix; they are raised before anything is
submitted.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

SECTION = "submit"
"""The top-level key of the submit parameters in a training config file."""

_TIME = re.compile(
    r"^(?:(?P<d>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?|(?P<a>\d+)(?::(?P<b>\d+)(?::(?P<c>\d+))?)?)$"
)


class SubmitConfigError(ValueError):
    """A submit parameter is wrong; the message names it and the fix."""


@dataclass
class SubmitConfig:
    """One SLURM job running one training over ``nodes`` nodes, one task per GPU."""

    nodes: int = 1
    """Nodes to allocate; no more than the partition has."""
    gpus_per_node: int = 0
    """GPUs per node (0 on CPU-only clusters); one task runs per GPU."""
    tasks_per_node: int | None = None
    """Tasks per node; defaults to ``gpus_per_node`` (one per GPU), or 1 without GPUs."""
    time: str | None = None
    """Time limit, in SLURM's format (``MM``, ``HH:MM:SS``, ``D-HH:MM``...). Required: if the batch host dies,
    SLURM keeps the job RUNNING until its time limit."""
    partition: str | None = None
    """SLURM partition; ``None``: the cluster's default partition."""
    job_name: str = "oobleck"
    log_dir: str = "oobleck-logs"
    """submitit's folder; each job writes its logs and results to ``log_dir/JOB_ID``."""
    script: str | None = None
    """The training script each task runs (as ``__main__``), unless a Python function is submitted."""
    args: list[str] = field(default_factory=list)
    """Command-line arguments of ``script``."""
    sbatch: dict[str, Any] = field(default_factory=dict)
    """Extra ``#SBATCH`` options, e.g. ``{account: myproj, constraint: a100}``."""
    srun_args: list[str] = field(default_factory=list)
    """Extra ``srun`` options."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run in the batch script before the training step, e.g. ``module load cuda``."""
    check: bool = True
    """Run ``script`` once on the batch host up to the plan before the tasks start, so that a mistake ends
    the job in one line (:func:`~lightning_oobleck.slurm.task.check_script`); ``False`` where the script's
    preparation before ``Trainer.fit`` is too long to run twice."""
    poll_interval_s: float = 2.0
    """How often the job's state is polled while waiting."""

    def validate(self) -> None:
        """Check what can be checked without SLURM: counts, the time limit, the fault-tolerance flags."""
        if self.nodes < 1:
            raise SubmitConfigError(f"{SECTION}.nodes={self.nodes}: a job needs at least 1 node")
        if self.gpus_per_node < 0 or self.num_tasks_per_node < 1:
            raise SubmitConfigError(
                f"{SECTION}.gpus_per_node={self.gpus_per_node}, tasks_per_node={self.tasks_per_node}: "
                "need gpus_per_node >= 0 and tasks_per_node >= 1"
            )
        if self.time is None:
            raise SubmitConfigError(_missing_time())
        time_limit_minutes(self.time)
        for flag in ("requeue", "no-requeue", "no-kill"):
            if flag in self.sbatch:
                raise SubmitConfigError(
                    f"{SECTION}.sbatch.{flag} cannot be set: oobleck jobs always run with --no-kill "
                    "--no-requeue (a node failure must neither cancel nor requeue them)"
                )

    @property
    def command(self) -> tuple[str, ...]:
        """``script`` (an absolute path: the job may run elsewhere) and its ``args``; empty without one."""
        return (str(Path(self.script).absolute()), *self.args) if self.script is not None else ()

    @property
    def num_tasks_per_node(self) -> int:
        if self.tasks_per_node is not None:
            return self.tasks_per_node
        return self.gpus_per_node or 1

    @property
    def time_minutes(self) -> int:
        """The time limit in whole minutes (rounded up), as submitit takes it."""
        if self.time is None:
            raise SubmitConfigError(_missing_time())
        return time_limit_minutes(self.time)


def time_limit_minutes(value: str) -> int:
    """Minutes (rounded up) of a SLURM time limit: ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``.

    Raises :class:`SubmitConfigError` for anything else.
    """
    match = _TIME.match(str(value).strip())
    if not match:
        raise SubmitConfigError(
            f"{SECTION}.time={value!r} is not a SLURM time limit; "
            "write minutes ('90'), 'HH:MM:SS' or 'D-HH:MM'"
        )
    g = {k: int(v) for k, v in match.groupdict().items() if v is not None}
    if "d" in g:
        seconds = ((g["d"] * 24 + g["dh"]) * 60 + g.get("dm", 0)) * 60 + g.get("ds", 0)
    elif "c" in g:
        seconds = (g["a"] * 60 + g["b"]) * 60 + g["c"]
    else:
        seconds = g["a"] * 60 + g.get("b", 0)
    if seconds <= 0:
        raise SubmitConfigError(f"{SECTION}.time={value!r} is zero; give the job a positive time limit")
    return math.ceil(seconds / 60)


def load_submit_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> SubmitConfig:
    """The ``submit:`` section of ``path`` (if given), overridden by ``submit.KEY=VALUE`` dot-lists."""
    schema = OmegaConf.structured(SubmitConfig)
    sources: list[tuple[str, Any]] = []
    if path is not None:
        try:
            root = OmegaConf.load(path)
        except (OSError, OmegaConfBaseException) as e:
            raise SubmitConfigError(f"cannot read {path}: {e}") from e
        if not isinstance(root, DictConfig) or SECTION not in root:
            keys = list(root.keys()) if isinstance(root, DictConfig) else []
            hint = _did_you_mean(SECTION, [str(k) for k in keys])
            raise SubmitConfigError(f"{path} has no '{SECTION}:' section{hint}")
        section = root[SECTION]
        if isinstance(section, DictConfig) and isinstance(section.get("time"), int):
            raise SubmitConfigError(
                f'{path}: quote {SECTION}.time, e.g. time: "12:00:00" (YAML reads an unquoted 12:00:00 '
                "as the number 43200, and a number as minutes)"
            )
        sources.append((str(path), section))
    for item in overrides:
        if not item.startswith(f"{SECTION}.") or "=" not in item:
            raise SubmitConfigError(f"override {item!r} is not '{SECTION}.KEY=VALUE'")
        sources.append((f"override {item!r}", _parse_override(item.removeprefix(f"{SECTION}."))))
    merged: DictConfig = schema
    for where, source in sources:
        try:
            merged = OmegaConf.merge(merged, source)
        except ConfigKeyError as e:
            key = str(e.key) if getattr(e, "key", None) is not None else "?"
            hint = _did_you_mean(key, list(SubmitConfig.__dataclass_fields__))
            raise SubmitConfigError(f"{where}: unknown key '{SECTION}.{key}'{hint}") from e
        except OmegaConfBaseException as e:
            key = getattr(e, "full_key", None) or "?"
            reason = str(e).splitlines()[0]
            raise SubmitConfigError(f"{where}: bad value for '{SECTION}.{key}': {reason}") from e
    config = OmegaConf.to_object(merged)
    assert isinstance(config, SubmitConfig)
    config.validate()
    return config


def _parse_override(item: str) -> DictConfig:
    """``KEY=VALUE`` as OmegaConf reads it, except ``time``, kept verbatim: YAML would read ``12:00:00`` as
    the base-60 number 43200."""
    key, _, value = item.partition("=")
    if key == "time":
        return OmegaConf.create({"time": None if value in ("", "null", "~") else value})
    return OmegaConf.from_dotlist([item])


def _missing_time() -> str:
    return (
        f"{SECTION}.time is required (e.g. {SECTION}.time=02:00:00): without a time limit a job whose "
        "batch host dies stays RUNNING forever"
    )


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(choices)})" if choices else ""
