"""``benchmarks/gpu_check.py`` on the CPU: the comparisons it makes on a GPU, measured by the bytes of live
tensors instead of the CUDA allocator's statistics, so that the script is known to work before it first meets
a GPU. The model must pass there; a term a device disagrees with must be named, and fail the script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402

CPU = torch.device("cpu")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_comparison_of_the_check_holds_on_the_cpu(tmp_path: Path) -> None:
    # the loop section is the GPT example's run, which the example's tests run; its arguments are below
    out, sections = tmp_path / "check.json", ("profile", "stage", "generation")
    script = ROOT / "benchmarks" / "gpu_check.py"
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            "--device",
            "cpu",
            "--small",
            "--sections",
            *sections,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert {r["section"] for r in rows} == set(sections)
    assert all(r["ok"] for r in rows)
    terms = {r["term"] for r in rows if r["section"] == "stage"}
    assert {
        "parameters",
        "gradients",
        "backward peak",
        "optimizer state",
        "optimizer step temporaries",
        "peak",
        "peak under ZB-H1",
    } <= terms
    stages = {r["case"].split(":")[0] for r in rows if r["section"] == "stage"}
    assert len(stages) == gpu_check.STAGES
    cases = {r["case"] for r in rows if r["section"] == "profile"}
    assert len(cases) == 2 * len(gpu_check.MICROBATCHES)  # plain and recomputing at each micro-batch size
    assert "gloo, generation 1" in {r["case"] for r in rows if r["section"] == "generation"}


class ExtraPeak(gpu_check.LiveTensorBytes):
    """A fake allocator report: every peak is ``extra`` bytes above the tensors' (a workspace the model
    lacks)."""

    def __init__(self, extra: int) -> None:
        super().__init__()
        self.extra = extra

    def peak(self) -> int:
        return super().peak() + self.extra


def test_a_term_the_device_disagrees_with_is_named_and_fails_the_check() -> None:
    work = gpu_check.Workload(gpu_check.SMALL, CPU)
    meter = ExtraPeak(extra=2**20)
    with meter:
        rows = gpu_check.stage_rows(work, meter, 2)
    off = gpu_check.failures(rows)
    off_terms = {r.term for r in rows if not r.ok}
    assert off_terms == {"backward peak", "optimizer step temporaries", "peak", "peak under ZB-H1"}, off
    assert len(off) == 4 * gpu_check.STAGES
    assert all("measured" in line and "the model predicts" in line and "tolerance" in line for line in off)
    assert any("optimizer step temporaries" in line for line in off)


def test_the_check_refuses_a_gpu_run_without_a_gpu_and_says_what_to_run(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without a GPU, on any machine
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main([])
    assert exit_info.value.code == 2
    assert "--device cpu --small" in capsys.readouterr().err


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_loop_sections_arguments_are_the_examples(device: str) -> None:
    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    from train import parse_args  # examples/gpt

    _, cfg = parse_args(gpu_check.loop_arguments(torch.device(device), small=False))
    assert cfg.trainer.accelerator == ("gpu" if device == "cuda" else "cpu")
    assert (cfg.trainer.devices, cfg.trainer.precision, cfg.strategy.fault_tolerance) == (1, "bf16-mixed", 0)
    assert cfg.strategy.planner.cluster.device_memory_bytes == 80e9
