"""The sweep report: its numbers are the runs' own (summary.json, metrics.jsonl), pooled over seeds."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import pytest

from app.tools.report import ReportError, find_runs, main, write_report

TARGET = 0.9


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def _job(
    root: Path,
    overrides: list[str],
    accs: list[float],
    status: str = "completed",
    privacy: dict | None = None,
    rejected: int = 0,
    fedbuff: dict | None = None,
) -> Path:
    """A sweep job directory as app.tools.sweep and the ServerApp leave it."""
    job_dir = root / ",".join(sorted(overrides))
    job_dir.mkdir(parents=True)
    (job_dir / "job.json").write_text(
        json.dumps(
            {
                "status": status,
                "overrides": [*overrides, "sweep.name=x"],
                "error": "boom" if status == "failed" else None,
            }
        )
    )
    if status == "failed" and not accs:
        return job_dir
    rows = [
        {
            "round": i + 1,
            "accuracy": a,
            "loss": 1 - a,
            "wall_time_s": 2.0 * (i + 1),
            "num_rejected": rejected,
            "num_missing": 1,
        }
        for i, a in enumerate(accs)
    ]
    (job_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {
        "status": status,
        "final_accuracy": accs[-1],
        "best_accuracy": max(accs),
        "rounds_completed": len(accs),
        "wall_time_s": 2.0 * len(accs) + 0.5,
        "privacy": privacy or {"mechanism": "none"},
        "bytes_up_total": 1_000_000 * len(accs),
        "bytes_down_total": 2_000_000 * len(accs),
    }
    if fedbuff:
        summary["fedbuff"] = fedbuff
    (job_dir / "summary.json").write_text(json.dumps(summary))
    return job_dir


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    root = tmp_path / "sweep"
    _job(root, ["strategy=fedavg", "seed=0"], [0.5, 0.92, 0.95], rejected=1)
    _job(root, ["strategy=fedavg", "seed=1"], [0.6, 0.85, 0.91])
    _job(root, ["strategy=fedavg", "seed=2"], [0.4, 0.7, 0.8])
    _job(root, ["strategy=fedavg", "privacy=central", "seed=0"], [0.2, 0.3], privacy={"epsilon": 4.5})
    _job(root, ["strategy=fedavg", "privacy=central", "seed=1"], [0.3, 0.25], privacy={"epsilon": 5.5})
    _job(root, ["strategy=fedavg", "privacy=central", "seed=2"], [], status="failed")
    _job(root, ["strategy=fedbuff", "seed=0"], [0.9, 0.93], fedbuff={"discarded_stale": 7})
    return root


def test_report_numbers_equal_the_runs_summaries(sweep: Path) -> None:
    paths = write_report(sweep, target=TARGET)
    table = {row["config"]: row for row in _read_csv(paths["csv"])}
    assert set(table) == {"strategy=fedavg", "privacy=central strategy=fedavg", "strategy=fedbuff"}

    summaries = {
        d.name: json.loads((d / "summary.json").read_text()) for d in sweep.iterdir() if (d / "summary.json").exists()
    }
    plain = [s for name, s in summaries.items() if "privacy" not in name and "fedbuff" not in name]
    row = table["strategy=fedavg"]
    assert int(row["runs"]) == 3 and int(row["failed"]) == 0 and row["seeds"] == "0 1 2"
    # summaries from before configurable metrics: final_accuracy stands in for final_metric
    assert row["metric"] == "accuracy"
    finals = [s["final_accuracy"] for s in plain]
    assert float(row["final_metric_mean"]) == pytest.approx(statistics.mean(finals), rel=1e-12)
    assert float(row["final_metric_std"]) == pytest.approx(statistics.stdev(finals), rel=1e-12)
    assert float(row["best_metric_mean"]) == pytest.approx(statistics.mean(s["best_accuracy"] for s in plain))
    assert float(row["wall_time_s_mean"]) == pytest.approx(statistics.mean(s["wall_time_s"] for s in plain))
    # seed 0 reaches 0.9 in round 2 (t = 4 s), seed 1 in round 3 (t = 6 s), seed 2 never
    assert int(row["reached_target"]) == 2
    assert float(row["rounds_to_target_mean"]) == 2.5 and float(row["time_to_target_s_mean"]) == 5.0
    assert float(row["rejected_per_run"]) == pytest.approx(1.0)  # 3 rejected in seed 0, 0 in the others
    assert float(row["failed_replies_per_run"]) == 3.0  # one missing reply per round
    assert row["epsilon_mean"] == ""
    assert float(row["uplink_mb_mean"]) == 3.0 and float(row["downlink_mb_mean"]) == 6.0  # 1 and 2 MB a round, 3 rounds

    dp = table["privacy=central strategy=fedavg"]
    assert int(dp["runs"]) == 2 and int(dp["failed"]) == 1
    assert float(dp["epsilon_mean"]) == 5.0 and float(dp["final_metric_mean"]) == pytest.approx(0.275)
    assert int(dp["reached_target"]) == 0 and dp["rounds_to_target_mean"] == ""

    buff = table["strategy=fedbuff"]
    assert float(buff["stale_discarded_per_run"]) == 7 and buff["final_metric_std"] == ""  # one seed: no std

    runs = _read_csv(paths["runs_csv"])
    assert len(runs) == 7 and sum(r["status"] == "failed" for r in runs) == 1
    md = paths["md"].read_text()
    assert "| `strategy=fedavg` | 3 | 0 | 88.7 ± 7.8 |" in md  # (95 + 91 + 80) / 3 %, sample std
    assert "| final accuracy (%) | best accuracy (%) |" in md
    assert "boom" in md and paths["png"].stat().st_size > 0


def test_report_follows_each_runs_primary_metric(tmp_path: Path) -> None:
    """A run whose first task.metrics entry is auroc: its target, table and plot are in auroc."""
    root = tmp_path / "sweep"
    for seed, aurocs in ((0, [0.6, 0.85, 0.8]), (1, [0.7, 0.75, 0.95])):
        job = _job(root, ["task.metrics=[auroc,accuracy]", f"seed={seed}"], [0.1, 0.2, 0.3])
        rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
        for row, auroc in zip(rows, aurocs, strict=True):
            row["auroc"] = auroc
        (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        summary = json.loads((job / "summary.json").read_text())
        summary |= {"primary_metric": "auroc", "final_metric": aurocs[-1], "best_metric": max(aurocs)}
        (job / "summary.json").write_text(json.dumps(summary))
    paths = write_report(root, target=0.8)
    (row,) = _read_csv(paths["csv"])
    assert row["metric"] == "auroc" and float(row["final_metric_mean"]) == pytest.approx(0.875)
    assert float(row["best_metric_mean"]) == pytest.approx(0.9)
    assert int(row["reached_target"]) == 2 and float(row["rounds_to_target_mean"]) == 2.5  # auroc, not accuracy
    md = paths["md"].read_text()
    assert "Target auroc 0.8" in md and "| final auroc (%) | best auroc (%) |" in md and "| 87.5 ± 10.6 |" in md


def test_report_on_real_runs_and_on_a_single_run_dir(tmp_path: Path) -> None:
    """Runs written by the real ServerApp loop (in-process grid); no job.json, so the
    configuration comes from config.yaml: two seeds of one config pool into one row."""
    from app.tools.in_process import run_in_process

    root = tmp_path / "runs"
    summaries = []
    for seed in (3, 4):
        overrides = f"federation.rounds=2 train.epochs=1 seed={seed} name=s{seed} tracking.tensorboard=false"
        summaries.append(run_in_process(overrides, root)[0])
    (row,) = _read_csv(write_report(root, target=0.05)["csv"])
    assert int(row["runs"]) == 2 and row["seeds"] == "3 4"
    assert all(s["primary_metric"] == "accuracy" and s["final_metric"] == s["final_accuracy"] for s in summaries)
    finals = [s["final_metric"] for s in summaries]
    assert float(row["final_metric_mean"]) == pytest.approx(statistics.mean(finals), rel=1e-12)
    assert float(row["final_metric_std"]) == pytest.approx(statistics.stdev(finals), rel=1e-12)
    assert int(row["reached_target"]) == 2 and float(row["rounds_to_target_mean"]) == 1.0
    assert int(row["ledger_verified"]) == 2 and int(row["ledger_broken"]) == 0
    runs = {r["path"]: r for r in _read_csv(root / "runs.csv")}
    for summary in summaries:
        run = runs[str(Path(summary["run_dir"]).resolve())]
        assert run["ledger"] == "verified" and run["ledger_head"] == summary["ledger"]["head"]
        assert float(run["reported_compute_s"]) > 0

    # A ledger altered after the run: counted broken, named under the table with verify's reason.
    ledger = Path(summaries[1]["run_dir"]) / "ledger.jsonl"
    ledger.write_text(ledger.read_text().replace('"round"', '"version"', 1))
    paths = write_report(root, target=0.05)
    (row,) = _read_csv(paths["csv"])
    assert int(row["ledger_verified"]) == 1 and int(row["ledger_broken"]) == 1
    md = paths["md"].read_text()
    assert "| 1/2 (1 broken) |" in md and "- `s4`: entry 1 (step 1)" in md, md

    single = root / "s3"
    (row,) = _read_csv(write_report(single, target=0.05)["csv"])
    assert row["config"] == "s3" and int(row["runs"]) == 1
    assert float(row["final_metric_mean"]) == summaries[0]["final_metric"]
    assert len(find_runs(single)) == 1


def test_report_refuses_a_directory_without_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty" / ".hydra").mkdir(parents=True)
    with pytest.raises(ReportError, match="no runs under .*: expected a sweep directory"):
        write_report(tmp_path / "empty")
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "empty")])
    assert exit_.value.code == 2 and "no runs under" in capsys.readouterr().err
    with pytest.raises(ReportError, match="not a directory"):
        write_report(tmp_path / "missing")
