"""Signed work records (ledger.work_keys, app/ledger/work.py) and settlement (app/ledger/settle.py):
each refusal of a record, the records in the ledger and `verify`'s check of them, and payouts that
leave a rejected, excluded or free-riding node with nothing."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, RecordDict

from app.client_app import app as client_app
from app.config.schema import ConfigError
from app.ledger.__main__ import main as ledger_cli
from app.ledger.chain import GENESIS, LEDGER_FILE, entry_hash, read_entries
from app.ledger.settle import SettlementError, settle
from app.ledger.verify import WORK_KEYS, verify_run
from app.ledger.work import (
    FORMAT,
    WorkChecks,
    WorkRecordError,
    check_entries,
    fingerprint,
    load_public_keys,
    sign_work,
)
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


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("record", "[" * 100_000),  # the audit's: json's RecursionError used to end the run
        ("record", "[" * 1_500),  # under the length limit, past the parser's depth
        ("record", "{" * 10**6),
        ("signature", "A" * 10**6),
    ],
    ids=["100k-deep", "1500-deep", "1M-long", "long-signature"],
)
def test_a_record_too_long_or_too_deep_to_parse_is_refused_as_unreadable(tmp_path, field, value):
    checks, key = _checks(tmp_path)
    nonce = checks.issue(7)
    with pytest.raises(WorkRecordError, match="unreadable"):
        checks.check(sign_work(key, _claims(nonce=nonce)) | {field: value}, 7, "ab" * 32)
    assert checks.issued[7] == nonce


def test_verify_names_an_unreadable_record_or_line_in_a_ledger(tmp_path):
    (tmp_path / "keys").mkdir()
    _keys(tmp_path / "keys", ["lab"])
    keys = load_public_keys(tmp_path / "keys")
    nested = {"node_id": 7, "work": {"record": "[" * 100_000, "signature": "AA=="}}
    (problem,) = check_entries([{"step": 1, "run": "r1", "nodes": [nested]}], keys)
    assert "entry 1, node 7: work record unreadable" in problem
    (tmp_path / LEDGER_FILE).write_text("[" * 100_000 + "\n")
    (problem,) = verify_run(tmp_path)
    assert "line 1: not JSON (RecursionError" in problem


def test_one_public_key_registered_for_two_sites_is_refused_naming_both_files(tmp_path):
    """A site that hands in another site's public key as its own (public keys are public) used to
    take over that site's records: the later file won, silently."""
    keys = tmp_path / "keys"
    keys.mkdir()
    _keys(keys, ["site-0", "site-1"])
    shutil.copyfile(keys / "site-0.work.pub", keys / "zz-mallory.work.pub")
    with pytest.raises(ValueError, match=r"keys/site-0\.work\.pub and .*keys/zz-mallory\.work\.pub hold the same"):
        load_public_keys(keys)
    with pytest.raises(ConfigError, match="zz-mallory.work.pub hold the same public key"):
        run_in_process(f"ledger.work_keys={keys}", tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="the documented proof uses openssl")
def test_the_documented_signed_challenge_proves_a_site_holds_its_key(tmp_path):
    """docs/ledger.md#registering-a-sites-key: the site signs the operator's challenge with its work
    key, the operator checks it with the public key it is about to register; another key fails."""
    _keys(tmp_path, ["lab-a", "lab-b"])
    challenge = tmp_path / "lab-a.challenge"
    challenge.write_text("fedgpu work key registration: lab-a 0123456789abcdef\n")

    def openssl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["openssl", "dgst", "-sha384", *args], cwd=tmp_path, capture_output=True, text=True)

    assert openssl("-sign", "lab-a.work.key", "-out", "lab-a.proof", challenge.name).returncode == 0
    good = openssl("-verify", "lab-a.work.pub", "-signature", "lab-a.proof", challenge.name)
    assert good.returncode == 0 and "Verified OK" in good.stdout
    assert openssl("-verify", "lab-b.work.pub", "-signature", "lab-a.proof", challenge.name).returncode != 0


def test_a_resumed_check_keeps_each_keys_node_and_its_used_nonces(tmp_path):
    """The binding and the nonces live in memory: a restart used to start them empty, so a key bound
    to one node signed for another after a resume and the whole ledger then failed `verify`."""
    checks, key = _checks(tmp_path)
    work = sign_work(key, _claims(nonce=checks.issue(7)))
    checks.check(work, 7, "ab" * 32)
    entries = [{"step": 1, "run": "r1", "nodes": [{"node_id": 7, "work": checks.take(7)}, {"node_id": 9}]}]
    resumed = WorkChecks(checks.keys)
    resumed.run = "r1"
    resumed.take_up(entries)
    assert resumed.bound == {fingerprint(key.public_key()): 7}
    assert resumed.used == {json.loads(work["record"])["nonce"]}
    nonce = resumed.issue(8)
    with pytest.raises(WorkRecordError, match="lab's key already signs for node 7"):
        resumed.check(sign_work(key, _claims(nonce=nonce, node=8)), 8, "ab" * 32)
    assert resumed.check(sign_work(key, _claims(nonce=resumed.issue(7))), 7, "ab" * 32)


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
    signing), replay (round 1's signed reply sent again for round 2), nest (the record is 100 kB of
    `[`: the audit's, whose RecursionError used to end the run)."""

    def __init__(self, node: int, how: str) -> None:
        self.node, self.how, self.kept = node, how, None

    def __call__(self, node: int, reply: Message) -> Message:
        if node != self.node or reply.has_error():
            return reply
        content = reply.content
        work = dict(content[WORK])
        if self.how == "forge":
            work["record"] = work["record"].replace('"examples":', '"examples":1')  # 431.0 -> 1431.0
        elif self.how == "nest":
            work["record"] = "[" * 100_000
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
        rewritten = self.how in ("forge", "nest")
        content = RecordDict({**dict(content.items()), WORK: ConfigRecord(work)} if rewritten else content)
        return Message(content, reply_to=reply_to_same_task(reply))


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("forge", "the signature does not verify"),
        ("swap", "its arrays hash is not the reply's"),
        ("replay", "signs no open task"),
        ("nest", "unreadable"),
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
        FAST.format(rounds=2) + f" strategy=median ledger.work_keys={keys} ledger.work_required=false",
        tmp_path,
        grid=grid,
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
    overrides += " ledger.contribution=loo"  # the work rule under a rule that selects: scored (settle.py)
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


def _signed_ledger(run: Path, steps: list[dict]) -> None:
    """`run`/ledger.jsonl as a run with `ledger.work_keys` writes it, for the settlement's own checks:
    `steps` are entries without `run` and chain; each node record that has a `weight` gets a reply
    hash and a work record signed by the node's own registered key (`run`/work_keys/)."""
    nodes = sorted({n["node_id"] for e in steps for n in e["nodes"]})
    private = dict(zip(nodes, _keys(run / WORK_KEYS, [f"site-{n}" for n in nodes]), strict=True))
    prev, lines = GENESIS, []
    for entry in steps:
        entry = {"run": "r1", **entry}
        for n in entry["nodes"]:
            if "weight" in n:
                n["reply_sha256"] = hashlib.sha256(f"{entry['step']}/{n['node_id']}".encode()).hexdigest()
                key = serialization.load_pem_private_key(private[n["node_id"]].read_bytes(), password=None)
                claims = _claims(nonce=n["reply_sha256"][:32], node=n["node_id"], arrays_sha256=n["reply_sha256"])
                n["work"] = {**sign_work(key, claims), "site": f"site-{n['node_id']}"}
        entry["prev"] = prev
        entry["hash"] = prev = entry_hash(entry)
        lines.append(json.dumps(entry, sort_keys=True) + "\n")
    (run / LEDGER_FILE).write_text("".join(lines))


def _round(step: int, weights: str | None = "alike", unit: str = "round", **outcomes: str) -> dict:
    """An entry of nodes 1 (honest), 2 (honest) and 3 (the free-rider), each applied with weight 1
    unless `outcomes` says otherwise (`n3="excluded by multikrum"`)."""
    nodes = []
    for n in (1, 2, 3):
        outcome = outcomes.get(f"n{n}", "applied")
        weight = {"weight": 1.0 if weights == "alike" else 100.0 if n < 3 else 10**5} if outcome == "applied" else {}
        nodes.append({"node_id": n, "outcome": outcome, **weight})
    return {"step": step, "unit": unit, "nodes": nodes, **({"weights": weights} if weights else {})}


@pytest.mark.parametrize(
    ("steps", "why"),
    [
        ([_round(1, "claims"), _round(2, "claims")], "weighed updates by their claimed example counts"),
        ([_round(1, unit="version"), _round(2, unit="version")], "is a FedBuff version"),
        ([_round(1), _round(2, n1="excluded by multikrum")], "kept some updates and excluded others"),
        ([_round(1, None), _round(2, None)], "does not record how it weighed"),
    ],
    ids=["claims", "fedbuff", "selected", "old-ledger"],
)
def test_the_work_rule_without_scores_is_refused_where_a_free_rider_could_outweigh_an_honest_node(tmp_path, steps, why):
    """Under the default ledger.contribution=none the work rule paid the capped claim: free-riders that
    claimed the cap took 99.6 % of the pool (issue 48, finding 6). With scores the same ledger
    settles, and the free-rider (scored 0) earns nothing."""
    _signed_ledger(tmp_path, steps)
    assert verify_run(tmp_path) == []
    with pytest.raises(SettlementError, match=f"--rule work without contribution scores.*{why}.*ledger.contribution"):
        settle(tmp_path, 90.0, "work")
    assert ledger_cli(["settle", str(tmp_path), "--pool", "90", "--rule", "work"]) == 1
    scored = [_round(e["step"], e.get("weights"), e["unit"]) for e in steps]
    for e in scored:
        for n in e["nodes"]:
            n["contribution"] = 0.0 if n["node_id"] == 3 else 0.5
    _signed_ledger(tmp_path, scored)
    payees = {p.node_id: p.payout for p in settle(tmp_path, 90.0, "work")}
    assert payees == pytest.approx({1: 45.0, 2: 45.0, 3: 0.0})


def test_the_work_rule_without_scores_pays_a_rule_that_uses_every_update_alike(tmp_path):
    """A median or trimmed mean in rounds: each update the rule used weighs 1, whatever it claims, so a
    free-rider earns what an honest node answering the same tasks earns, never more."""
    _signed_ledger(tmp_path, [_round(1), _round(2), _round(3, n1="missing")])
    payees = {p.node_id: p for p in settle(tmp_path, 80.0, "work")}
    assert {n: p.payout for n, p in payees.items()} == pytest.approx({1: 20.0, 2: 30.0, 3: 30.0})
    assert payees[1].unpaid_steps == {"missing": 1} and payees[3].earning_steps == 3


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


@pytest.mark.parametrize("strategy", ["fedavg", "multikrum", "median"])
def test_signed_free_riders_never_earn_more_than_an_honest_node_without_scores(tmp_path, strategy):
    """The audit's set-up (issue 48, finding 6) under the default ledger.contribution=none: claiming the
    cap, the signed free-riders took 99.6 % of the pool under FedAvg. Now the work rule settles only where
    the rule gives every update it uses one equal weight (the median), and there they earn what an
    honest node earns, never more; elsewhere it is refused, and so nobody is paid more than an honest node."""
    from tests.test_ledger import FreeRiders

    riders = FreeRiders({1003: 1.0, 1004: 5.0})
    grid, keys, private = _grid(tmp_path, 6)
    grid.tamper = SignedFreeRiders(riders, {1003: private[3], 1004: private[4]})
    riders.grid = grid
    rule = f"strategy={strategy}" + (
        " strategy.num_byzantine=1 strategy.num_selected=3" if strategy == "multikrum" else ""
    )
    summary, _ = run_in_process(FAST.format(rounds=2) + f" {rule} ledger.work_keys={keys}", tmp_path, grid=grid)
    run = Path(summary["run_dir"])
    assert verify_run(run) == []
    if strategy != "median":
        with pytest.raises(SettlementError, match="--rule work without contribution scores"):
            settle(run, 600.0, "work")
        return
    entries = read_entries(run / LEDGER_FILE)
    assert all(e["weights"] == "alike" for e in entries)
    assert all(n["weight"] == 1.0 and n["share"] == pytest.approx(1 / 6) for e in entries for n in e["nodes"])
    payees = {p.node_id: p.payout for p in settle(run, 600.0, "work")}
    assert max(payees[1003], payees[1004]) <= min(payees[n] for n in (1000, 1001, 1002, 1005)) + 1e-9, payees
    assert sum(payees.values()) == pytest.approx(600.0)


def test_a_key_stays_bound_to_its_node_across_a_resume(tmp_path):
    """The audit's set-up (issue 48, finding 8): a site runs two SuperNodes with one work key; the key
    binds to the first node it signs for. After a restart the binding used to be empty, so the other
    node was taken while the first was busy, and `verify` then refused the whole ledger."""
    overrides = "train.epochs=1 seed=5 name=led resume=auto"
    grid, keys, private = _grid(tmp_path, 3)
    grid.contexts[1002].node_config["work-key"] = str(private[0])  # the site's second SuperNode
    first, _ = run_in_process(f"federation.rounds=2 {overrides} ledger.work_keys={keys}", tmp_path, grid=grid)
    entries = read_entries(Path(first["run_dir"]) / LEDGER_FILE)
    bound = next(n["node_id"] for n in entries[0]["nodes"] if n["node_id"] in (1000, 1002) and "work" in n)
    other = 1002 if bound == 1000 else 1000
    grid2, _, _ = _grid(tmp_path / "again", 3)
    for node, context in grid2.contexts.items():
        context.node_config["work-key"] = grid.contexts[node].node_config["work-key"]

    def busy(node: int, reply: Message) -> Message:
        return Message(Error(code=0, reason="busy"), reply_to=reply_to_same_task(reply)) if node == bound else reply

    grid2.tamper = busy
    second, _ = run_in_process(f"federation.rounds=3 {overrides} ledger.work_keys={keys}", tmp_path, grid=grid2)
    run = Path(second["run_dir"])
    (last,) = [e for e in read_entries(run / LEDGER_FILE) if e["step"] == 3]
    outcome = {n["node_id"]: n["outcome"] for n in last["nodes"]}
    assert outcome[other] == f"rejected: work record: site-0's key already signs for node {bound}", outcome
    assert verify_run(run) == []


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
    with pytest.raises(SettlementError, match="step 1 weighed updates by their claimed example counts"):
        settle(run, 60.0, "work")  # unscored FedBuff (its mean buffer weighs claims; any buffer favours the fastest)
