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
