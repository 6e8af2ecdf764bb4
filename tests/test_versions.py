"""The supported version range: what the package declares is what CI tests, and it installs into an
environment that already has torch, Lightning and transformers (a cluster's image) without replacing them."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PINNED_BY_IMAGES = ("torch", "lightning", "transformers")


def _declared() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] + project["optional-dependencies"]["hf"]
    requirements = [Requirement(line) for line in lines]
    return {r.name: r for r in requirements if r.name in PINNED_BY_IMAGES}


def _pins(path: Path) -> dict[str, str]:
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    return dict(line.split("==") for line in lines if line)


def test_the_oldest_environment_pins_each_lower_bound_the_package_declares() -> None:
    pins = _pins(ROOT / "constraints-oldest.txt")
    for name, requirement in _declared().items():
        lower = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
        assert lower == [Version(pins[name])], (
            f"pyproject.toml accepts {requirement} but constraints-oldest.txt (tox -e oldest) tests "
            f"{name}=={pins.get(name)}: keep the declared lower bound and the oldest tested release the same"
        )


def test_the_newest_environment_is_inside_the_declared_range() -> None:
    pins = _pins(ROOT / "constraints-cpu.txt")
    assert pins["torch"] in _declared()["torch"].specifier


@pytest.mark.timeout(120)
def test_installs_beside_the_installed_torch_lightning_and_transformers_without_replacing_them(
    tmp_path: Path,
) -> None:
    # Resolved against what is installed only (no index): any release of these three that pip wanted
    # instead of the installed one would be an error or an entry of the report's install list.
    report = tmp_path / "report.json"
    pip = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation"]
    done = subprocess.run(
        [*pip, "--quiet", "--report", str(report), f"{ROOT}[hf]"],
        capture_output=True,
        text=True,
        timeout=100,
    )
    installed = {name: version(name) for name in PINNED_BY_IMAGES}
    assert done.returncode == 0, f"does not install beside {installed}: {done.stderr}"
    planned = {item["metadata"]["name"] for item in json.loads(report.read_text())["install"]}
    assert planned == {"lightning-oobleck"}, f"installing it would also install {planned} beside {installed}"
