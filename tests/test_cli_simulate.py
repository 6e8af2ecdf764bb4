"""``oobleck simulate``: one row per policy, JSON, the plot, one-line errors."""

from __future__ import annotations

import json

import pytest

from lightning_oobleck.cli import main

JOB = ["simulate", "--layers", "16", "--nodes", "8", "--gpus-per-node", "1", "--global-batch", "256"]
JOB += ["--microbatch", "2", "--set", "job.model.hidden=1024", "--set", "job.model.seq_len=1024"]
FIXED = ["--set", "trace.kind=fixed", "--set", "trace.removals=3", "--set", "trace.interval_h=0.5"]


def test_fixed_removals_in_json_and_a_plot(tmp_path, capsys) -> None:
    plot = tmp_path / "throughput.png"
    code = main([*JOB, *FIXED, "--horizon-h", "3", "--json", "--plot", str(plot)])
    out = capsys.readouterr().out
    assert code == 0
    data = json.loads(out)
    assert data["trace"] == {"nodes": 8, "horizon_h": 3.0, "failures": 3, "returns": 0}
    results = {r["policy"]: r for r in data["results"]}
    assert set(results) == {
        "oobleck",
        "oobleck-reroute",
        "oobleck-auto",
        "checkpoint-restart",
        "replica-groups",
    }
    assert all(r["samples"] <= r["failure_free_samples"] for r in results.values())
    assert results["oobleck"]["samples"] > results["checkpoint-restart"]["samples"]
    assert results["oobleck"]["events"] == 3 and results["oobleck"]["final_pipelines"] >= 1
    assert plot.stat().st_size > 10_000


def test_table_with_a_poisson_trace_and_returns(capsys) -> None:
    args = ["--horizon-h", "24", "--set", "trace.failures_per_node_day=2", "--set", "trace.repair_mean_h=2"]
    code = main([*JOB, *args])
    out = capsys.readouterr().out
    assert code == 0
    assert "oobleck" in out and "checkpoint-restart" in out and "ms per event" in out
    # the batch host's machine fails too: its standby takes over (or, with it lost, a restart): said below
    assert main([*JOB, *args, "--json"]) == 0
    [oobleck] = [r for r in json.loads(capsys.readouterr().out)["results"] if r["policy"] == "oobleck"]
    hits, restarts = oobleck["coordinator_failures"], oobleck["coordinator_restarts"]
    said = (
        f"{hits} failure(s) hit the machine of the coordinator and the store (SLURM's batch host at first): "
    )
    assert hits > 0 and said + f"{hits - restarts} taken over by its standby, {restarts} charged" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--set", "trace.kind=weibull"], "unknown trace.kind 'weibull'"),
        (["--set", "policies=[varuna]"], "unknown policy 'varuna'"),
        (["--set", "trace.kind=file"], "trace.kind=file needs trace.file=PATH"),
        (["--set", "trace.kinds=fixed"], "unknown key 'trace.kinds'"),
    ],
)
def test_bad_input_is_one_line_exit_2(argv: list[str], message: str, capsys) -> None:
    assert main([*JOB, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
