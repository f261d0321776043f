"""The contribution ledger (app/ledger/): a run's chain verifies; any alteration, removal or
reordering of entries, or a replaced model file, is detected and named; resume continues the
chain; outcomes say what became of each node's update."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.ledger.chain import LEDGER_FILE, entry_hash, model_digest, read_entries
from app.ledger.report import cumulative_contributions, node_totals
from app.ledger.verify import verify_run
from app.tools.in_process import run_in_process

FAST = "federation.rounds={rounds} train.epochs=1 seed=5"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    summary, _ = run_in_process(FAST.format(rounds=3), tmp_path_factory.mktemp("ledger"), nodes=3)
    return Path(summary["run_dir"])


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    out.mkdir()
    for name in (LEDGER_FILE, "summary.json", "model_final.pt", "checkpoint.pt"):
        (out / name).write_bytes((run_dir / name).read_bytes())
    return out


def _write(path: Path, entries: list[dict]) -> None:
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))


def test_a_runs_ledger_verifies_and_records_every_task(run_dir):
    assert verify_run(run_dir) == []
    entries = read_entries(run_dir / LEDGER_FILE)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [e["step"] for e in entries] == [1, 2, 3]
    assert summary["ledger"]["head"] == entries[-1]["hash"] and summary["ledger"]["entries"] == 3
    assert all(e["model_before"] == p["model_after"] for p, e in zip(entries, entries[1:], strict=False))
    assert model_digest(torch.load(run_dir / "model_final.pt", weights_only=True)) == entries[-1]["model_after"]
    for e in entries:
        assert sorted(n["node_id"] for n in e["nodes"]) == [1000, 1001, 1002]
        assert all(n["outcome"] == "applied" and len(n["reply_sha256"]) == 64 for n in e["nodes"])
        assert sum(n["share"] for n in e["nodes"]) == pytest.approx(1.0)
    cli = subprocess.run([sys.executable, "-m", "app.ledger", "verify", str(run_dir)], capture_output=True, text=True)
    assert cli.returncode == 0 and "ledger OK" in cli.stdout, cli


@pytest.mark.parametrize(
    ("tamper", "words"),
    [
        ("alter", "entry 2 (step 2) was altered"),
        ("alter_and_rehash", "entry 3 (step 3) does not follow entry 2"),
        ("remove", "entry 2 (step 3) does not follow entry 1"),
        ("reorder", "entry 2 (step 3) does not follow entry 1"),
        ("drop_last", "entries were removed or added at the end"),
        ("final_model", "model_final.pt is not the model the last entry (step 3) records"),
    ],
)
def test_tampering_is_detected_and_named(run_dir, tmp_path, tamper, words):
    copy = _copy(run_dir, tmp_path)
    path = copy / LEDGER_FILE
    entries = read_entries(path)
    if tamper == "alter":
        entries[1]["nodes"][0]["weight"] *= 10  # a node's credit inflated
    elif tamper == "alter_and_rehash":
        entries[1]["nodes"][0]["outcome"] = "rejected: made up"
        entries[1]["hash"] = entry_hash(entries[1])
    elif tamper == "remove":
        del entries[1]
    elif tamper == "reorder":
        entries[1], entries[2] = entries[2], entries[1]
    elif tamper == "drop_last":
        entries.pop()
    elif tamper == "final_model":
        state = torch.load(copy / "model_final.pt", weights_only=True)
        next(t for t in state.values() if t.is_floating_point()).add_(1e-3)
        torch.save(state, copy / "model_final.pt")
    _write(path, entries)
    problems = verify_run(copy)
    assert any(words in p for p in problems), problems
    cli = subprocess.run([sys.executable, "-m", "app.ledger", "verify", str(copy)], capture_output=True, text=True)
    assert cli.returncode == 1 and words in cli.stderr


def test_resume_continues_the_chain_and_the_receipts(tmp_path):
    from app.client_app import RECEIPTS
    from app.client_app import app as client_app
    from app.simulation.local_grid import InProcessGrid

    first = run_in_process(FAST.format(rounds=2) + " name=led resume=auto", tmp_path)[0]
    grid = InProcessGrid(client_app, 3)  # new node processes: their states start empty
    resumed = run_in_process(FAST.format(rounds=4) + " name=led resume=auto", tmp_path, grid=grid)[0]
    assert resumed["run_dir"] == first["run_dir"]
    entries = read_entries(Path(resumed["run_dir"]) / LEDGER_FILE)
    assert [e["step"] for e in entries] == [1, 2, 3, 4] and entries[2]["prev"] == first["ledger"]["head"]
    assert verify_run(Path(resumed["run_dir"])) == []
    # round 3's tasks carry the receipt for step 2, recorded before the resume
    assert dict(grid.contexts[1000].state[RECEIPTS]) == {str(e["step"]): e["hash"] for e in entries[1:3]}


def test_krum_exclusions_and_rejections_are_on_record(tmp_path):
    summary, _ = run_in_process(
        FAST.format(rounds=2)
        + " strategy=multikrum strategy.num_byzantine=1 strategy.num_selected=3 attack=sign_flip attack.num_malicious=1"
        " attack.scale=10",
        tmp_path,
        nodes=5,
    )
    run = Path(summary["run_dir"])
    assert verify_run(run) == []
    outcomes = [n["outcome"] for e in read_entries(run / LEDGER_FILE) for n in e["nodes"]]
    assert sum(o == "excluded by multikrum" for o in outcomes) == 4, outcomes  # 2 of 5 left out a round
    totals = node_totals(run)
    partitions = {
        int(k): v for k, v in json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["node_partitions"].items()
    }
    attackers = [n for n, p in partitions.items() if p in summary["attack"]["malicious_partitions"]]
    (attacker,) = attackers
    assert next(r for r in totals if r["node_id"] == attacker)["excluded"] == 2, totals  # never applied
    assert totals[-1]["applied"] == 0  # the report lists it last (no weight used)


def test_fedbuff_versions_are_on_record(tmp_path):
    summary, _ = run_in_process(FAST.format(rounds=3) + " strategy=fedbuff strategy.buffer_size=2", tmp_path, nodes=3)
    run = Path(summary["run_dir"])
    assert verify_run(run) == []
    entries = read_entries(run / LEDGER_FILE)
    assert [e["unit"] for e in entries] == ["version"] * 3
    applied = [n for e in entries for n in e["nodes"] if n["outcome"] == "applied"]
    assert all("staleness" in n and len(n["reply_sha256"]) == 64 for n in applied) and len(applied) >= 6


@pytest.mark.parametrize("method", ["loo", "shapley"])
def test_fedbuff_versions_score_the_buffer_and_rank_a_sign_flipper_last(tmp_path, method):
    overrides = " strategy=fedbuff strategy.buffer_size=4 attack=sign_flip attack.num_malicious=1 attack.scale=4"
    summary, _ = run_in_process(FAST.format(rounds=6) + overrides + f" ledger.contribution={method}", tmp_path, nodes=5)
    run = Path(summary["run_dir"])
    assert verify_run(run) == []
    entries = read_entries(run / LEDGER_FILE)
    for e in entries:  # every node with an update in the buffer is scored, once per version
        scored = [n["node_id"] for n in e["nodes"] if "contribution" in n]
        applied = {n["node_id"] for n in e["nodes"] if n["outcome"] == "applied"}
        assert applied <= set(scored) and len(scored) == len(set(scored)), e["nodes"]
    (attacker,) = summary["attack"]["malicious_partitions"]
    totals = node_totals(run)
    assert totals[-1]["node_id"] == 1000 + attacker, totals
    assert totals[-1]["contribution"] < 0 < totals[0]["contribution"]


def test_ledger_off_writes_none(tmp_path):
    summary, _ = run_in_process(FAST.format(rounds=1) + " ledger=off", tmp_path)
    assert not (Path(summary["run_dir"]) / LEDGER_FILE).exists() and "ledger" not in summary


@pytest.mark.parametrize("method", ["loo", "shapley"])
def test_a_sign_flipping_node_has_the_lowest_cumulative_contribution_under_fedavg(tmp_path, method):
    summary, _ = run_in_process(
        FAST.format(rounds=4) + f" attack=sign_flip attack.num_malicious=1 attack.scale=4 ledger.contribution={method}",
        tmp_path,
        nodes=5,
    )
    run = Path(summary["run_dir"])
    assert verify_run(run) == []
    entries = read_entries(run / LEDGER_FILE)
    assert all("contribution" in n for e in entries for n in e["nodes"])
    (attacker,) = summary["attack"]["malicious_partitions"]
    totals = node_totals(run)  # highest contribution first
    assert totals[-1]["node_id"] == 1000 + attacker, totals  # in-process node 1000 + i holds partition i
    assert totals[-1]["contribution"] < 0 < totals[0]["contribution"]
    cli = subprocess.run([sys.executable, "-m", "app.ledger", "report", str(run)], capture_output=True, text=True)
    assert cli.returncode == 0 and cli.stdout.strip().splitlines()[-4].startswith(f"| {1000 + attacker} |")
    assert cli.stdout.strip().endswith(f"plot: {run / 'ledger_report.png'}")
    assert (run / "ledger_report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    steps, curves = cumulative_contributions(run)  # the plot's lines end at the table's totals
    assert steps == [1, 2, 3, 4] and {n: c[-1] for n, c in curves.items()} == pytest.approx(
        {r["node_id"]: r["contribution"] for r in totals}
    )


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ("ledger.contribution=loo privacy=central", "outside central DP"),
        ("ledger.contribution=loo ledger=off", "set ledger=on"),
        ("ledger.contribution=banzhaf", "ledger.contribution"),
    ],
)
def test_contribution_settings_that_cannot_work_are_refused(overrides, words):
    from app.config.compose import load_config
    from app.config.schema import ConfigError

    with pytest.raises(ConfigError, match=words):
        load_config(overrides)


def test_each_task_carries_the_receipt_of_the_nodes_previous_reply(tmp_path):
    from app.client_app import RECEIPTS
    from app.client_app import app as client_app
    from app.simulation.local_grid import InProcessGrid

    grid = InProcessGrid(client_app, 3)
    grid.contexts[1001].node_config["state-dir"] = str(tmp_path / "site-b")
    summary, _ = run_in_process(FAST.format(rounds=3), tmp_path, grid=grid)
    entries = read_entries(Path(summary["run_dir"]) / LEDGER_FILE)
    expected = {str(e["step"]): e["hash"] for e in entries[:2]}  # round 3's receipt would come with round 4
    for node in (1000, 1001, 1002):
        assert dict(grid.contexts[node].state[RECEIPTS]) == expected
    kept = [json.loads(line) for line in (tmp_path / "site-b" / "ledger-receipts-run1.jsonl").read_text().splitlines()]
    assert kept == [{"step": int(k), "hash": v} for k, v in expected.items()]


def test_a_signed_ledger_verifies_with_its_public_key_and_a_forgery_fails(tmp_path):
    import base64

    from app.ledger.signing import SIGNATURE_FILE
    from tests.helpers import load_script

    credentials = load_script("credentials")
    private, public = credentials.make_ledger_key(tmp_path / "keys")
    _, other = credentials.make_ledger_key(tmp_path / "other")
    summary, _ = run_in_process(FAST.format(rounds=2) + f" ledger.signing_key={private}", tmp_path)
    run = Path(summary["run_dir"])
    assert verify_run(run, public) == []
    assert any("does not match this public key" in p for p in verify_run(run, other))
    signed = json.loads((run / SIGNATURE_FILE).read_text())
    forged = bytearray(base64.b64decode(signed["signature"]))
    forged[-1] ^= 1
    (run / SIGNATURE_FILE).write_text(json.dumps({**signed, "signature": base64.b64encode(forged).decode()}))
    assert any("does not match this public key" in p for p in verify_run(run, public))
    cli = subprocess.run(
        [sys.executable, "-m", "app.ledger", "verify", str(run), "--public-key", str(public)],
        capture_output=True,
        text=True,
    )
    assert cli.returncode == 1 and "signature" in cli.stderr


def test_an_unreadable_signing_key_stops_the_run_before_training(tmp_path):
    from app.config.schema import ConfigError

    bad = tmp_path / "not-a-key.pem"
    bad.write_text("hello")
    with pytest.raises(ConfigError, match="not a readable unencrypted PEM private key"):
        run_in_process(FAST.format(rounds=1) + f" ledger.signing_key={bad}", tmp_path)


def test_node_keys_are_named_as_ssh_keygen_prints_them(tmp_path):
    """A registered SuperNode's key (PEM, as the SuperLink stores it, or OpenSSH) gives the
    fingerprint `ssh-keygen -lf` prints; a run whose grid lists keys records them per node."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from flwr.proto.node_pb2 import NodeInfo

    from app.client_app import app as client_app
    from app.ledger.nodes import key_fingerprint
    from app.simulation.local_grid import InProcessGrid

    pems, expected = {}, {}
    for i, node in enumerate((1000, 1001)):  # node 1002 has no key: simulation, or no node auth
        public = ec.generate_private_key(ec.SECP384R1()).public_key()
        ssh = public.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        (tmp_path / f"n{i}.pub").write_bytes(ssh + b"\n")
        out = subprocess.run(["ssh-keygen", "-lf", str(tmp_path / f"n{i}.pub")], capture_output=True, text=True)
        expected[node] = out.stdout.split()[1]
        pems[node] = public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        assert key_fingerprint(pems[node]) == key_fingerprint(ssh) == expected[node]
    assert key_fingerprint(b"") is None and key_fingerprint(b"not a key") is None

    class KeyedGrid(InProcessGrid):
        asked = 0

        def get_nodes(self):  # noqa: ANN202 - what Flower's grid returns in a deployment
            KeyedGrid.asked += 1
            return [NodeInfo(node_id=n, public_key=pems.get(n, b"")) for n in self.get_node_ids()]

    summary, _ = run_in_process(FAST.format(rounds=2), tmp_path / "runs", grid=KeyedGrid(client_app, 3))
    run = Path(summary["run_dir"])
    assert verify_run(run) == []
    records = [n for e in read_entries(run / LEDGER_FILE) for n in e["nodes"]]
    assert len(records) == 6 and {n["node_id"]: n.get("node_key") for n in records} == {**expected, 1002: None}
    assert KeyedGrid.asked == 1  # asked once, when the ids were new
