"""Every command's missing or unreadable file is one line on stderr and exit status 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_oobleck.cli import main

TRAIN = Path(__file__).resolve().parents[1] / "examples" / "gpt" / "train.py"


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--nodes", "4", "--profile", "missing.json"],
        ["plan", "--nodes", "4", "--config", "missing.yaml"],
        ["replan", "--plan", "missing.json", "--fail", "1"],
        ["simulate", "--nodes", "4", "--profile", "missing.json"],
        ["simulate", "--nodes", "4", "--config", "missing.yaml"],
        ["timeline", "missing.jsonl"],
        ["consolidate", "missing.ckpt", "model.ckpt"],
    ],
)
def test_a_missing_file_is_one_line_and_status_2(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"oobleck {argv[0]}: error: ") and "missing" in err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_the_examples_missing_config_is_one_line_and_status_2(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(TRAIN), "--config", "missing.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 2
    assert "--config missing.yaml: no such file" in run.stderr and "Traceback" not in run.stderr


def test_join_takes_the_training_command_after_dashes_wherever_its_options_stand(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``oobleck join JOBID --nodes 1 -- SCRIPT ARGS``, as the README writes it (the submission itself is
    tested on the local SLURM cluster: ``tests/slurm``; here only what the parser hands it)."""
    submitted: list[tuple] = []
    monkeypatch.setattr(
        "lightning_oobleck.cli.join.submit_join",
        lambda *args, **kwargs: submitted.append((args, kwargs)) or "17",
    )
    for argv in (
        ["join", "16", "--nodes", "2", "--", "train.py", "--config", "my.yaml"],
        ["join", "--nodes", "2", "16", "--", "train.py", "--config", "my.yaml"],
    ):
        assert main(argv) == 0
        args, kwargs = submitted[-1]
        assert args == ("16", 2) and kwargs["command"] == ["train.py", "--config", "my.yaml"]
    assert main(["join", "16"]) == 0 and submitted[-1][1]["command"] == []  # the running job's command
    assert capsys.readouterr().out.count("submitted job 17: ") == 3


def test_a_command_after_dashes_where_none_is_taken_is_one_line_and_status_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["timeline", "events.jsonl", "--", "train.py"])
    assert exited.value.code == 2
    assert "oobleck timeline takes no command after '--'" in capsys.readouterr().err
