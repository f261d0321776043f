"""bench/gpu_check.py on the CPU (`--quick --device cpu`): it runs as a plain file, writes
gpu_check.json, passes the ClientApp check a CPU can run and says why it skipped the others."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import ROOT

CHECKS = (
    "amp_resnet18",
    "client_loop_vs_plain",
    "capped_clients",
    "oom_recovered",
    "client_reply",
    "ddp_nccl",
    "aggregation_cuda_vs_cpu",
)


def test_gpu_check_on_the_cpu_runs_a_client_and_says_why_it_skipped_the_rest(tmp_path):
    out = tmp_path / "check"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out", str(out), "--quick", "--device", "cpu"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    checks = json.loads((out / "gpu_check.json").read_text())["checks"]
    assert sorted(checks) == sorted(CHECKS)
    assert checks["client_reply"]["verdict"] == "pass", checks["client_reply"]
    reply = checks["client_reply"]["metrics"]
    assert reply["batch-size"] == 32 and reply["oom-retries"] == 0 and reply["gpu-telemetry"] == 0.0
    for name, result in checks.items():
        assert result["verdict"] in ("pass", "skipped") and (result["verdict"] == "pass" or result["why"]), name
