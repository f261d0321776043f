"""scripts/gpu_smoke.py on the CPU (`--quick --device cpu`): it runs as a plain file, records every
check in smoke.json, passes the checks a CPU can prove and says why it skipped the others."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from tests.helpers import ROOT

CHECKS = (
    "telemetry",
    "fedbuff_momentum_resume",
    "device_index_refused",
    "amp_modes",
    "timer_excludes_autotuning",
    "channels_last",
    "aggregation_cuda_vs_cpu",
    "threads_share_gpu",
    "deterministic",
    "bf16_choice",
    "lora_checkpointing",
    "rng_resume_fewer_gpus",
    "local_dp",
    "client_loop_vs_plain",
    "hidden_gpu_notice",
    "device_seconds",
)
PROVEN_ON_CPU = ("deterministic", "local_dp", "amp_modes", "lora_checkpointing")


def test_gpu_smoke_on_the_cpu_passes_what_it_can_and_says_why_it_skipped_the_rest(tmp_path):
    out = tmp_path / "smoke"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_smoke.py"), "--out", str(out), "--quick", "--device", "cpu"],
        cwd=tmp_path,  # a plain file, run from outside the repository
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    report = json.loads((out / "smoke.json").read_text())
    checks = report["checks"]
    assert sorted(checks) == sorted(CHECKS)
    for name, result in checks.items():
        assert result["verdict"] in ("pass", "skipped"), (name, result.get("why"))
        if result["verdict"] == "skipped":
            assert result.get("why"), name
    assert all(checks[name]["verdict"] == "pass" for name in PROVEN_ON_CPU), {n: checks[n] for n in PROVEN_ON_CPU}
    assert report["failed"] == [] and sorted(report["passed"] + report["skipped"]) == sorted(CHECKS)
    assert report["device"] == "cpu" and report["machine"]["torch"] == torch.__version__
    assert "skipped" in proc.stdout and "smoke.json" in proc.stdout  # the table and where the figures are
