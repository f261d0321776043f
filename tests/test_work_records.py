"""Signed work records (ledger.work_keys, app/ledger/work.py) and settlement (app/ledger/settle.py):
each refusal of a record, the records in the ledger and `verify`'s check of them, and payouts that
leave a rejected, excluded or free-riding node with nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

from app.client_app import app as client_app
from app.config.schema import ConfigError
from app.ledger.__main__ import main as ledger_cli
from app.ledger.chain import LEDGER_FILE, entry_hash, read_entries
from app.ledger.settle import SettlementError, settle
from app.ledger.verify import verify_run
from app.ledger.work import FORMAT, WorkChecks, WorkRecordError, fingerprint, load_public_keys, sign_work
from app.protocol import ARRAYS, CONFIG, WORK, WORK_NONCE, WORK_RUN
from app.simulation.local_grid import InProcessGrid
from app.tools.in_process import run_in_process
from strategies.replies import arrays_digest
from tests.helpers import ROOT, load_script, reply_to_same_task
from tests.test_flwr_cli import flwr_env, flwr_run, run_status  # noqa: F401 - flwr_env is a fixture

FAST = "federation.rounds={rounds} train.epochs=1 seed=5"
credentials = load_script("credentials")


def _keys(directory: Path, names: list[str]) -> list[Path]:
    """Key pairs made as a user makes them (scripts/credentials.py work-keys): the private paths."""
    return [private for private, _ in credentials.make_work_keys(directory, names)]


def _grid(tmp_path: Path, nodes: int, tamper=None) -> tuple[InProcessGrid, Path, list[Path]]:  # noqa: ANN001
    """An in-process grid whose nodes each hold their own registered work key."""
    keys = tmp_path / "keys"
    keys.mkdir(parents=True)
    private = _keys(keys, [f"site-{i}" for i in range(nodes)])
    grid = InProcessGrid(client_app, nodes, tamper=tamper)
    for path, context in zip(private, grid.contexts.values(), strict=True):
        context.node_config["work-key"] = str(path)
    return grid, keys, private


def _claims(**extra) -> dict:  # noqa: ANN003
    base = {"run": "r1", "nonce": "n", "step": 1, "task": 0, "node": 7, "examples": 10.0, "steps": 3}
    return base | {"wall_s": 1.0, "device_s": 0.5, "arrays_sha256": "ab" * 32} | extra


def _checks(tmp_path: Path) -> tuple[WorkChecks, ec.EllipticCurvePrivateKey]:
    (private,) = _keys(tmp_path, ["lab"])
    key = serialization.load_pem_private_key(private.read_bytes(), password=None)
    checks = WorkChecks(load_public_keys(tmp_path))
    checks.run = "r1"
    return checks, key


# --- the record and its checks, one refusal at a time -------------------------------------------


def test_a_record_for_the_open_task_verifies_once(tmp_path):
    checks, key = _checks(tmp_path)
    nonce = checks.issue(7)
    work = sign_work(key, _claims(nonce=nonce))
    record = checks.check(work, 7, "ab" * 32)
    assert record["format"] == FORMAT and record["key"] == fingerprint(key.public_key())
    assert checks.take(7)["site"] == "lab" and checks.take(7) is None
    with pytest.raises(WorkRecordError, match="no open task"):  # the same record again: a replay
        checks.check(work, 7, "ab" * 32)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda w, n: w | {"record": w["record"].replace('"examples":10.0', '"examples":1000.0')}, "does not verify"),
        (lambda w, n: w | {"signature": "AAAA"}, "does not verify"),
        (lambda w, n: w | {"record": "{not json"}, "unreadable"),
        (lambda w, n: {"record": w["record"]}, "unreadable"),
    ],
)
def test_a_changed_record_or_signature_is_refused(tmp_path, change, message):
    checks, key = _checks(tmp_path)
    nonce = checks.issue(7)
    with pytest.raises(WorkRecordError, match=message):
        checks.check(change(sign_work(key, _claims(nonce=nonce)), nonce), 7, "ab" * 32)


def test_a_record_of_another_run_task_node_key_or_arrays_is_refused(tmp_path):
    checks, key = _checks(tmp_path)
    nonce = checks.issue(7)
    refused = {
        "another run": (sign_work(key, _claims(nonce=nonce, run="r0")), 7, "ab" * 32, "no open task"),
        "an earlier task": (sign_work(key, _claims(nonce="an-older-nonce")), 7, "ab" * 32, "no open task"),
        "another node's task": (sign_work(key, _claims(nonce=nonce)), 8, "ab" * 32, "no open task"),
        "other arrays": (sign_work(key, _claims(nonce=nonce)), 7, "cd" * 32, "arrays hash is not the reply's"),
        "an unregistered key": (
            sign_work(ec.generate_private_key(ec.SECP384R1()), _claims(nonce=nonce)),
            7,
            "ab" * 32,
            "unregistered key",
        ),
    }
    for what, (work, node, digest, message) in refused.items():
        with pytest.raises(WorkRecordError, match=message):
            checks.check(work, node, digest)
        assert checks.issued[7] == nonce, what  # a refused record does not use the task's nonce up
    checks.issue(8)
    with pytest.raises(WorkRecordError, match="signs for node 7"):  # node 8's task, node 7's record
        checks.check(sign_work(key, _claims(nonce=checks.issued[8])), 8, "ab" * 32)


def test_one_key_signs_for_one_node(tmp_path):
    checks, key = _checks(tmp_path)
    assert checks.check(sign_work(key, _claims(nonce=checks.issue(7))), 7, "ab" * 32)
    nonce = checks.issue(8)
    with pytest.raises(WorkRecordError, match="lab's key already signs for node 7"):
        checks.check(sign_work(key, _claims(nonce=nonce, node=8)), 8, "ab" * 32)


def test_a_missing_record_is_refused_only_where_required(tmp_path):
    checks, _ = _checks(tmp_path)
    with pytest.raises(WorkRecordError, match="missing"):
        checks.check(None, 7, "ab" * 32)
    checks.required = False
    assert checks.check(None, 7, "ab" * 32) is None


def test_bad_settings_are_refused_before_any_work(tmp_path):
    from app.config.compose import load_config

    with pytest.raises(ConfigError, match="no <site>.work.pub files"):
        run_in_process(f"ledger.work_keys={tmp_path}", tmp_path / "runs")
    assert not (tmp_path / "runs").exists()
    with pytest.raises(ConfigError, match="set ledger=on"):
        load_config(f"ledger=off ledger.work_keys={tmp_path}")
    with pytest.raises(ConfigError, match="SecAgg"):
        load_config(f"secagg=plus ledger.work_keys={tmp_path}")


# --- through the real ClientApp and ServerApp loop -------------------------------------------------


class Tamper:
    """Rewrites one node's reply: `how` in forge (a signed field changed), swap (arrays changed after
    signing), replay (round 1's signed reply sent again for round 2)."""

    def __init__(self, node: int, how: str) -> None:
        self.node, self.how, self.kept = node, how, None

    def __call__(self, node: int, reply: Message) -> Message:
        if node != self.node or reply.has_error():
            return reply
        content = reply.content
        work = dict(content[WORK])
        if self.how == "forge":
            work["record"] = work["record"].replace('"examples":', '"examples":1')  # 431.0 -> 1431.0
        elif self.how == "swap":
            state = content[ARRAYS].to_torch_state_dict()
            key = next(iter(state))
            state[key] = state[key] + 1
            content = RecordDict({**dict(content.items()), ARRAYS: ArrayRecord(state)})
        elif self.how == "replay":
            if self.kept is None:
                self.kept = content
                return reply
            content = self.kept
        content = RecordDict({**dict(content.items()), WORK: ConfigRecord(work)} if self.how == "forge" else content)
        return Message(content, reply_to=reply_to_same_task(reply))


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("forge", "the signature does not verify"),
        ("swap", "its arrays hash is not the reply's"),
        ("replay", "signs no open task"),
    ],
)
def test_a_forged_swapped_or_replayed_reply_is_refused_and_the_run_goes_on(tmp_path, how, reason):
    tamper = Tamper(1001, how)
    grid, keys, _ = _grid(tmp_path, 3, tamper)
    summary, _ = run_in_process(FAST.format(rounds=2) + f" ledger.work_keys={keys}", tmp_path, grid=grid)
    assert summary["status"] == "completed"
    run = Path(summary["run_dir"])
    entries = read_entries(run / LEDGER_FILE)
    outcome = {(e["step"], n["node_id"]): n["outcome"] for e in entries for n in e["nodes"]}
    bad_round = 2 if how == "replay" else 1
    assert outcome[(bad_round, 1001)].startswith(f"rejected: work record: {reason}"), outcome
    assert all(outcome[(r, n)] == "applied" for r in (1, 2) for n in (1000, 1002))
    assert all("work" in n for e in entries for n in e["nodes"] if n["outcome"] == "applied")
    assert verify_run(run) == []


def test_signed_records_reach_the_ledger_verify_and_a_rewritten_ledger_is_caught(tmp_path):
    grid, keys, _ = _grid(tmp_path, 3)
    summary, _ = run_in_process(FAST.format(rounds=2) + f" ledger.work_keys={keys}", tmp_path, grid=grid)
    run = Path(summary["run_dir"])
    entries = read_entries(run / LEDGER_FILE)
    sites = set()
    for entry in entries:
        for node in entry["nodes"]:
            record = json.loads(node["work"]["record"])
            sites.add(node["work"]["site"])
            assert (record["run"], record["node"], record["step"]) == (entry["run"], node["node_id"], entry["step"])
            assert record["arrays_sha256"] == node["reply_sha256"] and record["examples"] == node["reported_examples"]
            assert record["steps"] > 0 and record["device_s"] > 0
    assert sites == {"site-0", "site-1", "site-2"}
    assert sorted(p.name for p in (run / "work_keys").iterdir()) == sorted(p.name for p in keys.glob("*.pub"))
    assert verify_run(run) == [] and ledger_cli(["verify", str(run), "--work-keys", str(keys)]) == 0
    # another registry (keys the sites never held): every record is named
    other = tmp_path / "other"
    _keys(other, ["site-0"])
    assert sum("unregistered key" in p for p in verify_run(run, work_keys=other)) == 6
    # a record's claim raised and the chain re-hashed around it: the signature gives it away
    record = json.loads(entries[0]["nodes"][0]["work"]["record"])
    entries[0]["nodes"][0]["work"]["record"] = json.dumps(record | {"examples": 10**6}, sort_keys=True)
    # and a record copied into the next entry: a reused nonce
    entries[1]["nodes"][1]["work"] = entries[0]["nodes"][1]["work"]
    prev = "0" * 64
    for e in entries:
        e["prev"] = prev
        e["hash"] = prev = entry_hash(e)
    (run / LEDGER_FILE).write_text("".join(json.dumps(e, sort_keys=True) + "\n" for e in entries))
    problems = verify_run(run)
    assert any("entry 1" in p and "signature does not verify" in p for p in problems), problems
    assert any("entry 2" in p and "reuses a nonce" in p for p in problems), problems
    with pytest.raises(SettlementError, match="does not verify"):
        settle(run, 100.0, "work")


def test_a_node_without_a_key_counts_unpaid_where_records_are_optional(tmp_path):
    grid, keys, _ = _grid(tmp_path, 3)
    del grid.contexts[1002].node_config["work-key"]
    summary, _ = run_in_process(
        FAST.format(rounds=2) + f" ledger.work_keys={keys} ledger.work_required=false", tmp_path, grid=grid
    )
    run = Path(summary["run_dir"])
    payees = {p.node_id: p for p in settle(run, 90.0, "work")}
    assert payees[1002].payout == 0 and payees[1002].unpaid_steps == {"no signed work record": 2}
    assert payees[1000].payout + payees[1001].payout == pytest.approx(90.0)


# --- settlement -----------------------------------------------------------------------------------


def _payout_by_work(run: Path, pool: float) -> dict[int, float]:
    """The work rule in closed form, straight from the ledger's applied and signed records."""
    weights: dict[int, float] = {}
    for e in read_entries(run / LEDGER_FILE):
        for n in e["nodes"]:
            earned = n["outcome"] == "applied" and "work" in n and n.get("contribution", 1) > 0
            weights[n["node_id"]] = weights.get(n["node_id"], 0.0) + (n["weight"] if earned else 0.0)
    total = sum(weights.values())
    return {node: pool * w / total for node, w in weights.items()}


def test_a_sign_flipper_excluded_by_multikrum_earns_nothing(tmp_path):
    grid, keys, _ = _grid(tmp_path, 5)
    overrides = "strategy=multikrum strategy.num_byzantine=1 attack=sign_flip attack.num_malicious=1"
    summary, _ = run_in_process(FAST.format(rounds=3) + f" {overrides} ledger.work_keys={keys}", tmp_path, grid=grid)
    run = Path(summary["run_dir"])
    attacker = {
        n["node_id"] for e in read_entries(run / LEDGER_FILE) for n in e["nodes"] if n["outcome"].startswith("excluded")
    }
    assert len(attacker) >= 1
    assert ledger_cli(["settle", str(run), "--pool", "1000", "--rule", "work"]) == 0
    paid = json.loads((run / "settlement.json").read_text())["payees"]
    expected = _payout_by_work(run, 1000.0)
    assert {p["node_id"]: p["payout"] for p in paid} == pytest.approx(expected)
    assert sum(p["payout"] for p in paid) == pytest.approx(1000.0)
    flipper = next(p for p in paid if p["node_id"] in attacker and p["earning_steps"] == 0)
    assert flipper["payout"] == 0 and "excluded by multikrum" in flipper["unpaid_steps"]
    assert (run / "settlement.csv").read_text().splitlines()[0].startswith("node_id,site,payout")


class SignedFreeRiders:
    """The ledger tests' free-riders (a replayed public step, the cap claimed), signing their replies
    with their own registered keys: the records verify; the scores must still leave them unpaid."""

    def __init__(self, riders, keys: dict[int, Path]) -> None:  # noqa: ANN001
        self.riders, self.keys = riders, keys

    def __call__(self, node: int, reply: Message) -> Message:
        out = self.riders(node, reply)
        if node not in self.keys or out is reply or reply.has_error():
            return out
        task = next(m for m in self.riders.grid.pushed if m.metadata.message_id == reply.metadata.reply_to_message_id)
        config = task.content[CONFIG]
        claims = json.loads(reply.content[WORK]["record"])
        claims |= {"arrays_sha256": arrays_digest(out.content[ARRAYS]), "examples": 10.0**9, "steps": 1}
        claims = {k: v for k, v in claims.items() if k not in ("format", "key")}
        assert claims["nonce"] == config[WORK_NONCE] and claims["run"] == config[WORK_RUN]
        key = serialization.load_pem_private_key(self.keys[node].read_bytes(), password=None)
        out.content[WORK] = ConfigRecord(sign_work(key, claims))
        return out


@pytest.mark.parametrize("rule", ["work", "contribution", "blend"])
def test_free_riders_with_valid_signatures_earn_nothing_under_any_rule(tmp_path, rule):
    from tests.test_ledger import FreeRiders

    riders = FreeRiders({1003: 1.0, 1004: 5.0})
    grid, keys, private = _grid(tmp_path, 6)
    grid.tamper = SignedFreeRiders(riders, {1003: private[3], 1004: private[4]})
    riders.grid = grid
    summary, _ = run_in_process(
        FAST.format(rounds=3) + f" ledger.contribution=loo ledger.work_keys={keys}", tmp_path, grid=grid
    )
    run = Path(summary["run_dir"])
    entries = read_entries(run / LEDGER_FILE)
    assert all("work" in n for e in entries for n in e["nodes"] if n["node_id"] in (1003, 1004))  # signed, verified
    payees = {p.node_id: p for p in settle(run, 600.0, rule, blend=0.25)}
    assert payees[1003].payout == payees[1004].payout == 0, payees
    assert sum(p.payout for p in payees.values()) == pytest.approx(600.0)
    assert all(payees[n].payout > 0 for n in (1000, 1001, 1002, 1005))
    if rule == "work":
        assert {n: p.payout for n, p in payees.items()} == pytest.approx(_payout_by_work(run, 600.0))


def test_settle_refuses_what_it_cannot_settle(tmp_path):
    summary, _ = run_in_process(FAST.format(rounds=1), tmp_path)
    run = Path(summary["run_dir"])
    with pytest.raises(SettlementError, match="no signed work records"):
        settle(run, 10.0, "work")
    with pytest.raises(SettlementError, match="positive amount"):
        settle(run, 0.0, "work")
    assert ledger_cli(["settle", str(run), "--pool", "10"]) == 1
    grid, keys, _ = _grid(tmp_path / "signed", 3)
    summary, _ = run_in_process(FAST.format(rounds=1) + f" ledger.work_keys={keys}", tmp_path, grid=grid)
    with pytest.raises(SettlementError, match="needs contribution scores"):
        settle(Path(summary["run_dir"]), 10.0, "contribution")


# --- the user's paths ------------------------------------------------------------------------------


def test_credentials_make_work_keys_that_the_server_registers(tmp_path):
    out = subprocess.run(
        [sys.executable, "scripts/credentials.py", "work-keys", "--out", str(tmp_path), "--names", "lab-a", "lab-b"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "lab-a.work.key" in out and oct((tmp_path / "lab-a.work.key").stat().st_mode & 0o777) == "0o600"
    assert {site for site, _ in load_public_keys(tmp_path).values()} == {"lab-a", "lab-b"}


def test_flwr_run_with_a_key_per_simulated_node(flwr_env, tmp_path):  # noqa: F811 - the imported fixture
    """`flwr run` as a user runs it: each simulated node signs with its own key (FEDGPU_WORK_KEY with
    the node's partition in it, in the environment the local SuperLink starts with: this module's
    first `flwr run`); the run's ledger holds a verified record for every reply."""
    keys = tmp_path / "keys"
    keys.mkdir()
    _keys(keys, [f"site-{i}" for i in range(3)])
    env = {**flwr_env, "FEDGPU_WORK_KEY": str(keys / "site-{partition-id}.work.key")}
    out_dir = tmp_path / "runs"
    code, out, run_id = flwr_run(env, out_dir, f"federation.rounds=2 train.epochs=1 ledger.work_keys={keys}")
    assert code == 0 and run_id, out[-4000:]
    assert run_status(env, run_id)["status"] == "finished:completed", out[-4000:]
    (summary,) = out_dir.rglob("summary.json")
    entries = read_entries(summary.parent / LEDGER_FILE)
    assert [len(e["nodes"]) for e in entries] == [3, 3]
    assert all(n["outcome"] == "applied" and "work" in n for e in entries for n in e["nodes"]), entries
    assert {n["work"]["site"] for e in entries for n in e["nodes"]} == {"site-0", "site-1", "site-2"}
    assert verify_run(summary.parent) == []


def test_fedbuff_checks_each_reply_and_records_the_verified_ones(tmp_path):
    """FedBuff screens each reply as it arrives: a forged record is refused there (its version's
    entry names it), the others are in the entries of the versions that used them."""
    grid, keys, _ = _grid(tmp_path, 4, Tamper(1002, "forge"))
    summary, _ = run_in_process(
        FAST.format(rounds=3) + f" strategy=fedbuff strategy.buffer_size=2 ledger.work_keys={keys}",
        tmp_path,
        grid=grid,
    )
    run = Path(summary["run_dir"])
    records = [n for e in read_entries(run / LEDGER_FILE) for n in e["nodes"]]
    assert any(n["node_id"] == 1002 and "work record: the signature does not verify" in n["outcome"] for n in records)
    applied = [n for n in records if n["outcome"] == "applied"]
    assert len(applied) == 6 and all("work" in n and n["node_id"] != 1002 for n in applied)
    assert verify_run(run) == []
    payees = {p.node_id: p.payout for p in settle(run, 60.0, "work")}
    assert payees.get(1002, 0) == 0 and sum(payees.values()) == pytest.approx(60.0)
