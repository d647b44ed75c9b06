"""`sweep` over every planner on the tiny recipe, tracked by a real `mlflow server`: the cells that do not
fit are planned and marked, the rest train, and the comparison printed at the end is what MLflow holds."""

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from helpers import RECIPES, MlflowServer
from osdp_planners.errors import UserError
from osdp_platform.driver.cli import EXIT_USER_ERROR, main
from osdp_platform.driver.sweep import expand

pytestmark = pytest.mark.heavy

# one cell that does not fit and two that train (each trains for real, the bulk of this test's time)
PLANNERS = ("osdp", "zero3", "ddp")
MIB = 1024**2


def test_comma_lists_expand_into_a_grid() -> None:
    assert expand(["a.x=1,2", "b.y=3", "c.z=4, 5"]) == [
        ["a.x=1", "b.y=3", "c.z=4"],
        ["a.x=1", "b.y=3", "c.z=5"],
        ["a.x=2", "b.y=3", "c.z=4"],
        ["a.x=2", "b.y=3", "c.z=5"],
    ]
    assert expand(["model.kwargs.dims=[1,2]"]) == [["model.kwargs.dims=[1,2]"]]  # a YAML list is one value
    with pytest.raises(UserError, match="empty"):
        expand(["planner.name=osdp,,zero3"])


def test_a_bad_cell_stops_the_sweep_before_anything_starts(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["sweep", str(RECIPES / "tiny.yaml"), "planner.name=osdp,fastest", f"tracking.uri=sqlite:///{workdir}/m.db"]
    )
    err = capsys.readouterr().err
    assert code == EXIT_USER_ERROR and "planner.name" in err and "fastest" in err
    assert not (workdir / "m.db").exists()


def _table(out: str) -> dict[str, list[str]]:
    """The printed Markdown comparison, keyed by the run id prefix in its first column."""
    lines = [line for line in out.splitlines() if line.startswith("| ") and "(" in line.split("|")[1]]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    return {row[0].rsplit("(", 1)[1].rstrip(")"): row for row in rows}


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def test_sweep_over_the_planners(
    ray_cluster: None, mlflow_server: MlflowServer, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "sweep",
            str(RECIPES / "tiny.yaml"),
            f"planner.name={','.join(PLANNERS)}",
            "train.steps=3",
            f"tracking.uri={mlflow_server.uri}",
            "tracking.experiment=sweep",
            "--format",
            "markdown",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    printed = _table(out)
    client = MlflowClient(mlflow_server.uri)
    experiment = client.get_experiment_by_name("sweep").experiment_id
    runs = client.search_runs([experiment])
    cells = [r for r in runs if r.data.tags["run_kind"] != "comparison"]
    assert sorted(r.data.tags["planner"] for r in cells) == sorted(PLANNERS)  # one run per cell
    assert len({r.data.tags["sweep"] for r in cells}) == 1
    assert len(printed) == len(PLANNERS), out
    trained = set()
    for run in cells:
        row = printed[run.info.run_id[:8]]
        tags, m = run.data.tags, run.data.metrics
        assert row[1] == tags["planner"]
        if tags["run_kind"] == "plan":  # planned, did not fit, never trained
            assert row[2] == "does not fit" and tags["plan_status"] == "does not fit"
            assert "fits" in tags["mlflow.note.content"] and "fix:" in tags["mlflow.note.content"]
            assert row[3:] == ["-"] * 8
            continue
        trained.add(tags["planner"])
        assert row[2] == "finished" and run.info.status == "FINISHED"
        p = run.data.params
        assert row[3] == f"{p['plan.micro_batch_size']} x {p['plan.grad_accum_steps']} x {p['plan.world_size']}"
        assert row[4] == f"{m['predicted_throughput_samples_per_s']:.2f}"
        assert row[5] == f"{m['measured_throughput_samples_per_s']:.2f}"
        uniform = {
            k.split("_")[1]: v
            for k, v in m.items()
            if k.endswith("_throughput_samples_per_s") and k.startswith("baseline_")
        }
        best = max(uniform, key=lambda k: uniform[k])
        assert row[6] == f"{m['predicted_throughput_samples_per_s'] / uniform[best]:.2f}x {best}"
        assert row[7] == f"{m['predicted_peak_memory_bytes'] / MIB:.2f}"
        assert row[8] == f"{m['measured_peak_memory_bytes'] / MIB:.2f}"
        assert row[9] == _num(m["step_time_ratio"] - 1, "+.1%")
        assert row[10] == _num(m["peak_memory_ratio"] - 1, "+.1%")
    assert {"osdp", "zero3"} <= trained and "ddp" not in trained  # DDP does not fit the tiny recipe's 8 MiB
    comparison = next(r for r in runs if r.data.tags["run_kind"] == "comparison")
    assert set(comparison.data.tags["compared_runs"].split()) == {r.info.run_id for r in cells}
    assert {"comparison.png", "comparison.md", "comparison.json"} <= {
        a.path for a in client.list_artifacts(comparison.info.run_id)
    }
    # reading the runs back writes nothing, and --wide shows every run id whole on one line
    assert main(["compare", "--uri", mlflow_server.uri, "--experiment", "sweep", "--wide"]) == 0
    wide = capsys.readouterr().out
    assert len(client.search_runs([experiment])) == len(runs)
    assert all(any(r.info.run_id in line for line in wide.splitlines()) for r in cells), wide
