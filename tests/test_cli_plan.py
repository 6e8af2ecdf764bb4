"""``oobleck plan`` / ``oobleck replan``: JSON schema, the issue's acceptance checks, one-line errors."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_oobleck.cli import main
from lightning_oobleck.planning import synthetic_gpt_profile
from lightning_oobleck.planning.planner import PlannerInputs

PLAN13 = ["plan", "--layers", "24", "--nodes", "13", "--gpus-per-node", "1", "--fault-tolerance", "2"]
PLAN13 += ["--global-batch", "512", "--microbatch", "4"]


def _run(argv: list[str], capsys) -> tuple[int, dict | str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, (json.loads(out) if "--json" in argv and code == 0 else out), err


@pytest.fixture
def plan13(tmp_path, capsys) -> Path:
    code, data, _ = _run([*PLAN13, "--json"], capsys)
    assert code == 0
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return path


def test_plan_json_uses_all_13_nodes_in_at_least_3_pipelines(plan13: Path) -> None:
    data = json.loads(plan13.read_text())
    assert data["fault_tolerance"] == 2 and data["n0"] >= 1
    assert sorted(n for p in data["pipelines"] for n in p["nodes"]) == list(range(13))
    assert len(data["pipelines"]) >= 3
    assert sum(p["microbatches"] for p in data["pipelines"]) == 128
    for t in data["templates"]:
        stages = t["stages"]
        assert stages[0]["layers"][0] == 0 and stages[-1]["layers"][1] == 24
        assert all(a["layers"][1] == b["layers"][0] for a, b in itertools.pairwise(stages))
        assert all(0 <= s["node"] < t["nodes"] for s in stages) and t["iteration_time_s"] > 0
    assert {p["template_nodes"] for p in data["pipelines"]} <= {t["nodes"] for t in data["templates"]}
    assert data["iteration_time_s"] > 0 and data["planning_s"] > 0


def test_replan_after_any_two_failures_keeps_every_layer_sourced(plan13: Path, capsys) -> None:
    before = json.loads(plan13.read_text())
    holders = {}
    for p in before["pipelines"]:
        template = next(t for t in before["templates"] if t["nodes"] == p["template_nodes"])
        for s in template["stages"]:
            for layer in range(*s["layers"]):
                holders.setdefault(p["nodes"][s["node"]], set()).add(layer)
    for failed in itertools.combinations(range(13), 2):
        code, data, err = _run(
            ["replan", "--plan", str(plan13), "--fail", ",".join(map(str, failed)), "--json"], capsys
        )
        assert code == 0, err
        nodes = sorted(n for p in data["pipelines"] for n in p["nodes"])
        assert nodes == sorted(set(range(13)) - set(failed)) and len(data["pipelines"]) >= 3
        held = {n: set(layers) for n, layers in holders.items() if n not in failed}
        for c in data["copies"]:
            assert c["from_node"] not in failed and c["layer"] in holders[c["from_node"]]
            assert c["replicas"] and all(
                n not in failed and c["layer"] in holders[n] for n, _ in c["replicas"]
            )
            held.setdefault(c["to_node"], set()).add(c["layer"])
        for p in data["pipelines"]:
            template = next(t for t in data["templates"] if t["nodes"] == p["template_nodes"])
            for s in template["stages"]:
                assert set(range(*s["layers"])) <= held[p["nodes"][s["node"]]]


def test_replan_add_gives_fresh_ids(plan13: Path, capsys) -> None:
    code, data, _ = _run(["replan", "--plan", str(plan13), "--add", "2", "--json"], capsys)
    assert code == 0
    assert sorted(n for p in data["pipelines"] for n in p["nodes"]) == list(range(15))
    assert {c["to_node"] for c in data["copies"]} >= {13, 14}


def test_tables_without_json(plan13: Path, capsys) -> None:
    code, out, _ = _run(PLAN13, capsys)
    assert code == 0 and "Pipeline templates" in out and "Pipelines" in out and "n0=" in out
    code, out, _ = _run(["replan", "--plan", str(plan13), "--fail", "3,7"], capsys)
    assert code == 0 and "Layer copies" in out


def test_replan_with_rerouting_moves_nothing_and_names_the_choice(plan13: Path, capsys) -> None:
    code, data, err = _run(
        ["replan", "--plan", str(plan13), "--fail", "3", "--policy", "reroute", "--json"], capsys
    )
    assert code == 0, err
    assert data["lost"] == [3] and data["copies"] == [] and data["reroutes"]
    assert sorted(n for p in data["pipelines"] for n in p["nodes"]) == list(range(13))  # the layout stays
    assert data["recovery"]["policy"] == "reroute"
    assert {c["policy"] for c in data["recovery"]["candidates"]} == {"reinstantiate", "reroute"}
    code, out, _ = _run(["replan", "--plan", str(plan13), "--fail", "3", "--policy", "auto"], capsys)
    assert code == 0 and "recovered by" in out and "samples before the next failure" in out
    code, out, _ = _run(["replan", "--plan", str(plan13), "--fail", "3", "--policy", "reroute"], capsys)
    assert code == 0 and "(lost:" in out  # the damaged pipeline names its lost node and the helpers


def test_rerouting_that_would_overfill_a_device_is_refused_and_says_why(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A measured profile of uneven layers on 7 nodes of 20 kB: losing node 2, pipeline 0's micro-batches
    would cross pipeline 1's stages, and pipeline 0's first stage (node 0) would warm up for the longer
    route, more than its device holds: the replan re-instantiates and says why."""
    monkeypatch.syspath_prepend(Path(__file__).parent / "planning")
    from test_rerouting import uneven_and_full

    profile = tmp_path / "profile.json"
    PlannerInputs.from_plan(uneven_and_full()).profile.save(profile)
    plan = [
        "plan",
        "--profile",
        str(profile),
        "--nodes",
        "7",
        "--gpus-per-node",
        "1",
        "--fault-tolerance",
        "1",
    ]
    plan += ["--global-batch", "28", "--microbatch", "1", "--set", "cluster.device_memory_bytes=20000"]
    code, data, err = _run([*plan, "--json"], capsys)
    assert code == 0, err
    (tmp_path / "plan.json").write_text(json.dumps(data))
    replan = ["replan", "--plan", str(tmp_path / "plan.json"), "--fail", "2", "--policy", "reroute", "--json"]
    code, data, err = _run(replan, capsys)
    assert code == 0, err
    assert data["recovery"]["policy"] == "reinstantiate" and "lost" not in data
    (refused,) = [c for c in data["recovery"]["candidates"] if c["policy"] == "reroute"]
    assert refused["infeasible"].startswith("worker (0, 0) would need")
    assert "of its device's 2e+04" in refused["infeasible"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--fault-tolerance", "9"], "f=9 needs 10 pipelines"),
        (["--global-batch", "510"], "not a multiple of the micro-batch 4"),
        (["--global-batch", "8"], "2 micro-batches cannot feed the 3 pipelines"),
        (["--set", "cluster.device_memory_bytes=1e9"], "does not fit on any number of nodes"),
        (["--set", "cluster.num_nodez=3"], "unknown key 'cluster.num_nodez'"),
    ],
)
def test_bad_plan_input_is_one_line_exit_2(argv: list[str], message: str, capsys) -> None:
    code, _, err = _run([*PLAN13, *argv], capsys)
    assert code == 2 and message in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--fail", "3,99"], "node id(s) [99] are not in the plan"),
        (["--fail", "3,x"], "--fail takes comma-separated node ids"),
        (["--fail", ",".join(map(str, range(12)))], "no pipeline fits"),
        (["--fail", "3,99", "--policy", "reroute"], "node id(s) [99] are not in the plan"),
        (["--add", "2", "--policy", "auto"], "give it with --fail, not --add"),
    ],
)
def test_bad_replan_input_is_one_line_exit_2(plan13: Path, argv: list[str], message: str, capsys) -> None:
    code, _, err = _run(["replan", "--plan", str(plan13), *argv], capsys)
    assert code == 2 and message in err and err.count("\n") == 1


def test_measured_profile_file(tmp_path, capsys) -> None:
    synthetic_gpt_profile(12, 1024, 1024, 2).save(tmp_path / "profile.json")
    argv = [
        "plan",
        "--profile",
        str(tmp_path / "profile.json"),
        "--nodes",
        "6",
        "--microbatch",
        "2",
        "--json",
    ]
    code, data, _ = _run(argv, capsys)
    assert code == 0 and data["num_layers"] == 12 and data["extra"]["profile"]["microbatch_size"] == 2
    code, _, err = _run([*argv[:-1], "--layers", "24"], capsys)
    assert code == 2 and "--layers 24 but the profile has 12 layers" in err


def test_missing_or_foreign_plan_file(tmp_path, capsys) -> None:
    code, _, err = _run(["replan", "--plan", str(tmp_path / "none.json"), "--add", "1"], capsys)
    assert code == 2 and "not found" in err
    (tmp_path / "x.json").write_text('{"gpus_per_node": 1}')
    code, _, err = _run(["replan", "--plan", str(tmp_path / "x.json"), "--add", "1"], capsys)
    assert code == 2 and "is not a plan" in err


@pytest.mark.timeout(60)
def test_installed_console_script() -> None:
    script = shutil.which("oobleck", path=str(Path(sys.executable).parent))
    assert script is not None
    done = subprocess.run([script, *PLAN13, "--json"], capture_output=True, text=True, timeout=60, check=True)
    data = json.loads(done.stdout)
    assert len(data["pipelines"]) >= 3 and sum(len(p["nodes"]) for p in data["pipelines"]) == 13


def test_plan_for_the_zero_bubble_schedule(capsys) -> None:
    small = [*PLAN13[:-4], "--global-batch", "128", "--microbatch", "1"]
    code, one_f_one_b, _ = _run([*small, "--json"], capsys)
    code, data, _ = _run([*small, "--schedule", "zb-h1", "--json"], capsys)
    assert code == 0 and data["schedule"] == "zb-h1"
    assert all(len(t["schedule_fit_s"]) == 2 for t in data["templates"])
    assert data["iteration_time_s"] < one_f_one_b["iteration_time_s"]
    code, out, _ = _run([*small, "--schedule", "zb-h1"], capsys)
    assert code == 0 and "schedule zb-h1" in out
    code, out, _ = _run([*small, "--schedule", "auto"], capsys)
    one_f_one_b_s, zero_bubble_s = one_f_one_b["iteration_time_s"], data["iteration_time_s"]
    assert code == 0 and "schedule zb-h1" in out
    assert f"schedule: 1f1b: {one_f_one_b_s:.3g} s/step; zb-h1: {zero_bubble_s:.3g} s/step" in out


def test_a_hand_written_layout_is_kept_and_replans_from_the_planners_templates(tmp_path, capsys) -> None:
    """``--layout`` keeps the pipelines as written; its JSON carries the planner's templates, so that
    ``replan --fail`` rebuilds a damaged pipeline like a planned one (the strategy recovers the same way)."""
    argv = ["plan", "--layers", "24", "--nodes", "6", "--gpus-per-node", "1", "--fault-tolerance", "1"]
    argv += ["--global-batch", "64", "--microbatch", "4", "--layout", "0,8,16,24;0,8,16,24", "--json"]
    code, data, _ = _run(argv, capsys)
    assert code == 0
    assert [p["nodes"] for p in data["pipelines"]] == [[0, 1, 2], [3, 4, 5]]
    stages = {t["nodes"]: [s["layers"] for s in t["stages"]] for t in data["templates"]}
    assert stages[3] == [[0, 8], [8, 16], [16, 24]]  # the layout's own split
    assert 2 in stages  # and the planner's template for the node count left after a failure
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    code, replanned, _ = _run(["replan", "--plan", str(path), "--fail", "1", "--json"], capsys)
    assert code == 0
    assert sorted(len(p["nodes"]) for p in replanned["pipelines"]) == [2, 3]
    assert sorted(n for p in replanned["pipelines"] for n in p["nodes"]) == [0, 2, 3, 4, 5]


@pytest.mark.parametrize(
    ("layout", "message"),
    [("0,8,x", "--layout takes boundaries like"), ("0,8,16,24", "--layout uses 3 nodes but --nodes is 6")],
)
def test_a_bad_layout_is_one_line_exit_2(layout: str, message: str, capsys) -> None:
    argv = ["plan", "--layers", "24", "--nodes", "6", "--gpus-per-node", "1", "--fault-tolerance", "0"]
    code, _, err = _run([*argv, "--global-batch", "64", "--microbatch", "4", "--layout", layout], capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
