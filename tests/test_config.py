"""load_config: defaults < YAML < overrides, and one-line errors that name the key and the fix."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from lightning_oobleck.config import ConfigError, load_config
from lightning_oobleck.planning.config import PlannerConfig


@dataclass
class Inner:
    size: int = 1
    rate: float = 0.5


@dataclass
class Outer:
    name: str = "x"
    inner: Inner = field(default_factory=Inner)

    def validate(self) -> None:
        if self.inner.size < 0:
            raise ValueError(f"inner.size must be >= 0, got {self.inner.size}")


def test_yaml_then_overrides_win(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("name: from-yaml\ninner:\n  size: 3\n  rate: 0.25\n")
    config = load_config(Outer, path, ["inner.size=7"])
    assert config == Outer("from-yaml", Inner(7, 0.25))
    assert load_config(Outer) == Outer()


def test_unknown_key_names_it_and_the_valid_ones(tmp_path) -> None:
    with pytest.raises(
        ConfigError,
        match=r"unknown key 'inner.sise' in the overrides \(did you mean 'size'\?\); valid keys here: size",
    ):
        load_config(Outer, overrides=["inner.sise=3"])
    path = tmp_path / "c.yaml"
    path.write_text("nmae: y\n")
    with pytest.raises(ConfigError, match=rf"unknown key 'nmae' in {path} \(did you mean 'name'\?\)"):
        load_config(Outer, path)
    # a key far from any valid one: no guess, the valid keys
    with pytest.raises(
        ConfigError, match=r"unknown key 'zzz' in the overrides; valid keys here: name, inner"
    ):
        load_config(Outer, overrides=["zzz=1"])


def test_wrong_type_malformed_override_missing_file_and_validation(tmp_path) -> None:
    with pytest.raises(
        ConfigError, match=r"inner.size: Value 'big' of type 'str' could not be converted to Integer"
    ):
        load_config(Outer, overrides=["inner.size=big"])
    with pytest.raises(ConfigError, match=r"override 'inner\.size' is not KEY=VALUE"):
        load_config(Outer, overrides=["inner.size"])
    with pytest.raises(ConfigError, match=r"config file .*nope\.yaml not found"):
        load_config(Outer, tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=r"inner\.size must be >= 0, got -2"):
        load_config(Outer, overrides=["inner.size=-2"])


def test_planner_config_validates_the_batch_and_builds_the_profile() -> None:
    config = load_config(PlannerConfig, overrides=["model.layers=12", "microbatch=2", "cluster.num_nodes=4"])
    assert config.load_profile().num_layers == 12 and config.load_profile().microbatch_size == 2
    with pytest.raises(ConfigError, match="not a multiple of the micro-batch 4"):
        load_config(PlannerConfig, overrides=["global_batch=10"])
    with pytest.raises(ConfigError, match=r"cluster\.num_nodes must be at least 1"):
        load_config(PlannerConfig, overrides=["cluster.num_nodes=0"])
