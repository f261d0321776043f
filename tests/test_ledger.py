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

from app.ledger.__main__ import main as ledger_cli
from app.ledger.chain import LEDGER_FILE, entry_hash, model_digest, read_entries
from app.ledger.totals import cumulative_contributions, node_totals
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
def test_tampering_is_detected_and_named(run_dir, tmp_path, capsys, tamper, words):
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
    # the CLI in process (test_a_runs_ledger_verifies_and_records_every_task runs it as one)
    assert ledger_cli(["verify", str(copy)]) == 1 and words in capsys.readouterr().err


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
    """Each receipt names the entry that recorded the node's last reply and that reply's hash as
    recorded, which is the hash the node computed of what it sent; the last reply's receipt, which
    no task carries, comes from `python -m app.ledger receipts`."""
    from app.client_app import RECEIPT_MISMATCHES, RECEIPTS, sent_hashes
    from app.client_app import app as client_app
    from app.simulation.local_grid import InProcessGrid

    grid = InProcessGrid(client_app, 3)
    grid.contexts[1001].node_config["state-dir"] = str(tmp_path / "site-b")
    summary, _ = run_in_process(FAST.format(rounds=3), tmp_path, grid=grid)
    run = Path(summary["run_dir"])
    entries = read_entries(run / LEDGER_FILE)
    expected = {str(e["step"]): e["hash"] for e in entries[:2]}  # round 3's receipt would come with round 4
    recorded = {e["step"]: next(n["reply_sha256"] for n in e["nodes"] if n["node_id"] == 1001) for e in entries}
    for node in (1000, 1001, 1002):
        assert dict(grid.contexts[node].state[RECEIPTS]) == expected
        assert RECEIPT_MISMATCHES not in grid.contexts[node].state
    assert sent_hashes(grid.contexts[1001]) == [recorded[1], recorded[2], recorded[3]]  # the node's own hashes
    site = tmp_path / "site-b" / "ledger-receipts-run1.jsonl"
    lines = [json.loads(line) for line in site.read_text().splitlines()]
    assert [x for x in lines if "step" in x] == [
        {"node_id": 1001, "step": int(k), "hash": v, "reply_sha256": recorded[int(k)]} for k, v in expected.items()
    ]
    assert [x["sent_sha256"] for x in lines if "sent_sha256" in x] == [recorded[1], recorded[2], recorded[3]]
    cli = [sys.executable, "-m", "app.ledger", "receipts", str(run), "--check", str(site)]
    out = subprocess.run(cli, capture_output=True, text=True)
    assert out.returncode == 0, out
    assert f"last reply: step 3, entry {entries[2]['hash']}, reply {recorded[3]}" in out.stdout
    kept = subprocess.run([*cli, "--keep"], capture_output=True, text=True)
    assert kept.returncode == 0 and "kept 1 receipts" in kept.stdout, kept
    last = json.loads(site.read_text().splitlines()[-1])
    assert (last["step"], last["hash"], last["reply_sha256"]) == (3, entries[2]["hash"], recorded[3])
    assert "receipt not in the file" not in subprocess.run(cli, capture_output=True, text=True).stdout


def test_a_node_detects_a_receipt_for_a_reply_it_did_not_send(tmp_path, caplog):
    """A reply altered on its way (or recorded as something else) gets a receipt whose reply hash is
    none of the node's own: the ClientApp logs it and keeps it, and the site's check names it."""
    import logging

    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

    from app.client_app import RECEIPT_MISMATCHES
    from app.client_app import app as client_app
    from app.simulation.local_grid import InProcessGrid
    from tests.helpers import reply_to_same_task

    def alter(node: int, reply: Message) -> Message:
        if node != 1001 or reply.has_error():
            return reply
        state = reply.content["arrays"].to_torch_state_dict()
        next(t for t in state.values() if t.is_floating_point()).add_(1e-3)
        content = RecordDict({"arrays": ArrayRecord(state), "metrics": MetricRecord(dict(reply.content["metrics"]))})
        return Message(content, reply_to=reply_to_same_task(reply))

    grid = InProcessGrid(client_app, 3, tamper=alter)
    grid.contexts[1001].node_config["state-dir"] = str(tmp_path / "site-b")
    with caplog.at_level(logging.WARNING):
        summary, _ = run_in_process(FAST.format(rounds=2), tmp_path, grid=grid)
    entries = read_entries(Path(summary["run_dir"]) / LEDGER_FILE)
    recorded = next(n["reply_sha256"] for n in entries[0]["nodes"] if n["node_id"] == 1001)
    assert dict(grid.contexts[1001].state[RECEIPT_MISMATCHES]) == {"1": recorded}
    assert RECEIPT_MISMATCHES not in grid.contexts[1000].state
    assert any("none of this node's last" in r.getMessage() for r in caplog.records)
    site = tmp_path / "site-b" / "ledger-receipts-run1.jsonl"
    assert any(json.loads(line).get("mismatch") for line in site.read_text().splitlines())
    out = subprocess.run(
        [sys.executable, "-m", "app.ledger", "receipts", summary["run_dir"], "--check", str(site)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1 and "which is none of the replies it sent" in out.stderr, out
    assert "is not in the ledger" in out.stderr  # what the node did send was never recorded


def test_conflicting_receipts_for_one_step_are_kept_and_reported(tmp_path, caplog):
    import logging

    from flwr.app import Context, RecordDict

    from app.client_app import RECEIPT_CONFLICTS, RECEIPTS, keep_receipt
    from app.protocol import RECEIPT_HASH, RECEIPT_REPLY, RECEIPT_STEP

    context = Context(
        run_id=7, node_id=1001, node_config={"state-dir": str(tmp_path)}, state=RecordDict(), run_config={}
    )
    first, second = "a" * 64, "b" * 64
    with caplog.at_level(logging.WARNING):
        for digest in (first, second, first, second):  # the same two, twice: kept once each
            keep_receipt({RECEIPT_STEP: 4, RECEIPT_HASH: digest, RECEIPT_REPLY: "c" * 64}, context)
    assert dict(context.state[RECEIPTS]) == {"4": first}  # the first receipt is never overwritten
    assert {k: list(v) for k, v in context.state[RECEIPT_CONFLICTS].items()} == {"4": [second]}
    assert sum("acknowledged as entry" in r.getMessage() for r in caplog.records) == 1
    site = tmp_path / "ledger-receipts-run7.jsonl"
    lines = [json.loads(line) for line in site.read_text().splitlines()]
    assert [(x["hash"], x.get("conflict", False)) for x in lines] == [(first, False), (second, True)]

    from app.ledger.receipts import check_receipts

    entries = [{"step": 4, "hash": first, "nodes": [{"node_id": 1001, "reply_sha256": "c" * 64}]}]
    problems, missing = check_receipts(entries, lines, 1001)
    assert any("conflicting receipts for step 4" in p for p in problems), problems
    assert any(f"names entry {second[:12]}" in p for p in problems) and missing == []


def test_truncating_the_ledger_is_atomic(tmp_path, monkeypatch):
    """A crash while a resume cuts the ledger back leaves the old file whole, never a part of it."""
    import app.ledger.chain as chain

    ledger = chain.Ledger(tmp_path)
    for step in (1, 2, 3):
        ledger.append({"step": step, "nodes": []})
    before = (tmp_path / LEDGER_FILE).read_bytes()

    def crash(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise OSError("simulated crash")

    monkeypatch.setattr(chain.os, "replace", crash)
    with pytest.raises(OSError, match="simulated crash"):
        ledger.truncate_after(1)
    assert (tmp_path / LEDGER_FILE).read_bytes() == before
    monkeypatch.undo()
    chain.Ledger(tmp_path).truncate_after(1)
    assert [e["step"] for e in read_entries(tmp_path / LEDGER_FILE)] == [1]
    assert not list(tmp_path.glob(".*.tmp"))


def _signed_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rounds: int = 3) -> tuple[Path, Path, list[str]]:
    """A signed run, its public key, and ledger.sig as it was after each signing."""
    import app.ledger.chain as chain
    from app.ledger.signing import SIGNATURE_FILE
    from tests.helpers import load_script

    private, public = load_script("credentials").make_ledger_key(tmp_path / "keys")
    signatures: list[str] = []
    original = chain.sign_head

    def recording(key, run_dir, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        original(key, run_dir, *args, **kwargs)
        signatures.append((Path(run_dir) / SIGNATURE_FILE).read_text())

    monkeypatch.setattr(chain, "sign_head", recording)
    summary, _ = run_in_process(FAST.format(rounds=rounds) + f" ledger.signing_key={private}", tmp_path / "runs")
    return Path(summary["run_dir"]), public, signatures


def test_an_old_signature_over_a_truncated_ledger_fails(tmp_path, monkeypatch):
    """The operator cuts the ledger back to step 2 and puts back the signature made after step 2
    (with summary.json to match and without the later model files): the signature says the run
    was still going then, and verify names it."""
    from app.ledger.signing import SIGNATURE_FILE

    run, public, signatures = _signed_run(tmp_path, monkeypatch)
    assert verify_run(run, public) == []
    assert json.loads((run / SIGNATURE_FILE).read_text())["status"] == "completed"
    entries = read_entries(run / LEDGER_FILE)
    cut = tmp_path / "cut"
    cut.mkdir()
    _write(cut / LEDGER_FILE, entries[:2])
    (cut / "config.yaml").write_bytes((run / "config.yaml").read_bytes())
    summary = json.loads((run / "summary.json").read_text())
    summary["ledger"] |= {"entries": 2, "head": entries[1]["hash"]}
    (cut / "summary.json").write_text(json.dumps(summary))
    old = next(s for s in signatures if json.loads(s)["entries"] == 2)
    (cut / SIGNATURE_FILE).write_text(old)
    assert verify_run(cut) == []  # the chain alone cannot tell
    problems = verify_run(cut, public)
    assert any("signed while the run was going (after step 2" in p for p in problems), problems


def test_a_signature_moved_to_another_run_or_config_fails(tmp_path, monkeypatch):
    from app.ledger.signing import SIGNATURE_FILE

    run, public, _ = _signed_run(tmp_path, monkeypatch, rounds=2)
    assert verify_run(run, public) == []
    body = json.loads((run / SIGNATURE_FILE).read_text())
    # the signed body claims another run: the signature no longer matches it
    (run / SIGNATURE_FILE).write_text(json.dumps({**body, "run": "0" * 32}))
    assert any("does not match this public key" in p for p in verify_run(run, public))
    (run / SIGNATURE_FILE).write_text(json.dumps(body))
    # the same chain's run id rewritten (and re-chained) under the signature: named
    copy = _copy(run, tmp_path)
    (copy / SIGNATURE_FILE).write_text(json.dumps(body))
    (copy / "config.yaml").write_bytes((run / "config.yaml").read_bytes())
    entries, prev = read_entries(copy / LEDGER_FILE), "0" * 64
    for e in entries:
        e |= {"run": "f" * 32, "prev": prev}
        e["hash"] = prev = entry_hash(e)
    _write(copy / LEDGER_FILE, entries)
    assert any(f"signs run {body['run']}, the ledger is run {'f' * 32}" in p for p in verify_run(copy, public))
    # another config under the same ledger and signature
    (run / "config.yaml").write_text((run / "config.yaml").read_text() + "# edited\n")
    problems = verify_run(run, public)
    assert any("the signature belongs to another config" in p for p in problems), problems
    assert any("config.yaml is not the config the last entry (step 2) was recorded under" in p for p in problems)


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


class FreeRiders:
    """A tamper (InProcessGrid) that turns nodes into free-riders with no data: each sends the
    global model it was sent plus `scale` times the last global step (w_t + s (w_t - w_{t-1}),
    public information: Lin et al. 2019's "delta weights" free-rider) and claims the cap."""

    def __init__(self, scales: dict[int, float]) -> None:
        self.scales = scales  # node -> scale of the replayed step
        self.grid = None
        self.globals: dict[int, dict] = {}  # round -> the global model its tasks carried

    def __call__(self, node: int, reply):  # noqa: ANN001, ANN204
        from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

        from app.protocol import ARRAYS, METRICS, NUM_EXAMPLES, PARTITION_ID, SERVER_ROUND
        from tests.helpers import reply_to_same_task

        task = next(m for m in self.grid.pushed if m.metadata.message_id == reply.metadata.reply_to_message_id)
        rnd = int(task.content["config"][SERVER_ROUND])
        now = self.globals.setdefault(rnd, task.content[ARRAYS].to_torch_state_dict())
        if node not in self.scales or reply.has_error():
            return reply
        before = self.globals.get(rnd - 1, now)
        s = self.scales[node]
        arrays = {k: (v + s * (v - before[k]) if v.is_floating_point() else v) for k, v in now.items()}
        # A node with no data: no partition to be held to, so its claim is cut to
        # federation.max_examples_per_node only (a deployed node's cap), far above the honest counts.
        metrics = {k: v for k, v in reply.content[METRICS].items() if k != PARTITION_ID} | {NUM_EXAMPLES: 10**9}
        content = RecordDict({ARRAYS: ArrayRecord(arrays), METRICS: MetricRecord(metrics)})
        return Message(content, reply_to=reply_to_same_task(reply))


@pytest.mark.parametrize("method", ["loo", "shapley"])
def test_free_riders_replaying_the_public_step_rank_below_every_honest_node(tmp_path, method):
    """A free-rider that replays the last global step, and one that replays it five times over,
    both claiming the cap, score below every honest node (docs/ledger.md#contribution-scores)."""
    from app.client_app import app as client_app
    from app.simulation.local_grid import InProcessGrid

    riders = FreeRiders({1003: 1.0, 1004: 5.0})
    grid = InProcessGrid(client_app, 6, tamper=riders)
    riders.grid = grid
    summary, _ = run_in_process(FAST.format(rounds=4) + f" ledger.contribution={method}", tmp_path, grid=grid)
    run = Path(summary["run_dir"])
    assert verify_run(run) == []
    totals = {r["node_id"]: r["contribution"] for r in node_totals(run)}
    per_round = [
        {n["node_id"]: round(n["contribution"], 4) for n in e["nodes"]} for e in read_entries(run / LEDGER_FILE)
    ]
    honest = [totals[n] for n in (1000, 1001, 1002, 1005)]
    assert max(totals[1003], totals[1004]) < min(honest), (totals, per_round)
    assert min(honest) > 0, totals  # honest nodes with real data still get positive credit
