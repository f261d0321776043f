"""Check a run's ledger against itself and against the files the run left.

- the chain: every entry hashes to its `hash` and links to the one before (chain.verify_chain);
- its end: summary.json records the head hash and the number of entries, so an entry cut off the
  end is caught too;
- its config: `config.yaml` hashes to the `config_sha256` the last entry was recorded under;
- its signature (with the operator's public key): `ledger.sig` signs this head and count, this
  run's id and config, after the last entry, as the run's final (sealed) signature;
- the signed work records (`ledger.work_keys`), with the keys the run copied into `work_keys/`
  (or others given): each verifies, names its run and node, signs the reply the entry records, once;
- the models: `model_final.pt` hashes to the last entry's `model_after`, and `checkpoint.pt` to
  the `model_after` of the step it was saved after.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from app.ledger.chain import CONFIG_FILE, LEDGER_FILE, file_digest, model_digest, read_entries, verify_chain
from app.ledger.signing import check_signature
from app.ledger.work import check_entries, load_public_keys

WORK_KEYS = "work_keys"  # the registered public keys a run with ledger.work_keys copied (app/run/work.py)


def verify_run(run_dir: Path, public_key: Path | None = None, work_keys: Path | None = None) -> list[str]:
    """The problems found (empty: the ledger holds), each naming the entry or file concerned;
    with `public_key`, ledger.sig must sign the chain's head with the matching private key;
    `work_keys`: the sites' public keys to check work records with (default: the run's copy)."""
    run_dir = Path(run_dir)
    path = run_dir / LEDGER_FILE
    if not path.exists():
        return [f"{path}: no ledger (a run with ledger=off, or not a run directory)"]
    try:
        entries = read_entries(path)
    except ValueError as err:
        return [f"{path}: {err}"]
    problems = []
    if (broken := verify_chain(entries)) is not None:
        problems.append(broken)
    summary_path = run_dir / "summary.json"
    summary_status = None
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
        summary_status = summary.get("status")
        recorded = summary.get("ledger")
        if recorded is not None:
            head = entries[-1]["hash"] if entries else None
            if recorded["entries"] != len(entries) or (entries and recorded["head"] != head):
                problems.append(
                    f"summary.json records {recorded['entries']} entries ending in {recorded['head'][:12]}, "
                    f"the ledger has {len(entries)}"
                    + (f" ending in {head[:12]}" if head else "")
                    + ": entries were removed or added at the end"
                )
    config = file_digest(run_dir / CONFIG_FILE)
    last_config = entries[-1].get("config_sha256") if entries else None
    if config is not None and last_config is not None and config != last_config:
        problems.append(
            f"{CONFIG_FILE} is not the config the last entry (step {entries[-1]['step']}) was recorded under"
        )
    if public_key is not None:
        problems += check_signature(run_dir, public_key, entries, config, summary_status)
    signed = any("work" in n for e in entries for n in e.get("nodes", []))
    keys_dir = work_keys or run_dir / WORK_KEYS
    if signed or work_keys is not None:
        try:
            problems += check_entries(entries, load_public_keys(keys_dir))
        except ValueError as err:
            problems.append(f"work records cannot be checked: {err}")
    final = run_dir / "model_final.pt"
    if entries and final.exists():
        state = torch.load(final, map_location="cpu", weights_only=True)
        if model_digest(state) != entries[-1].get("model_after"):
            problems.append(f"{final.name} is not the model the last entry (step {entries[-1]['step']}) records")
    checkpoint = run_dir / "checkpoint.pt"
    if entries and checkpoint.exists():
        payload = torch.load(checkpoint, map_location="cpu", weights_only=True)
        step = int(payload["round"])
        match = [e for e in entries if e.get("step") == step]
        if match and model_digest(payload["state_dict"]) != match[-1].get("model_after"):
            problems.append(f"{checkpoint.name} (after step {step}) is not the model entry {step} records")
    return problems
