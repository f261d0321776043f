"""The run's side of signed work records (`ledger.work_keys`, app/ledger/work.py): the registered
keys read and copied into the run before any task (with a resumed run's bindings and used nonces
taken up from its ledger), a nonce in every training task, each training reply's record checked
before the strategy uses anything of it, and the verified records put into the step's ledger entry."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message

from app.config.schema import ConfigError, LedgerConfig
from app.ledger.chain import Ledger, read_entries
from app.ledger.verify import WORK_KEYS
from app.ledger.work import PUBLIC_SUFFIX, WorkChecks, WorkRecordError, load_public_keys
from app.protocol import WORK, WORK_NONCE, WORK_RUN
from strategies.replies import InvalidReply, ReplyCheck, arrays_digest, records_of
from strategies.settings import NodeConfig

log = logging.getLogger("flwr.fedgpu." + __name__)


def work_checks(cfg: LedgerConfig) -> WorkChecks | None:
    """The checks `ledger.work_keys` asks for (None without it); ConfigError for a directory
    without usable keys, before the run writes anything."""
    if not cfg.work_keys:
        return None
    try:
        keys = load_public_keys(Path(cfg.work_keys).expanduser())
    except ValueError as err:
        raise ConfigError(str(err)) from None
    log.info(
        "ledger: signed work records %s, %d registered site key(s): %s",
        "required" if cfg.work_required else "checked where sent",
        len(keys),
        ", ".join(sorted(site for site, _ in keys.values())),
    )
    return WorkChecks(keys, required=cfg.work_required)


def open_work(checks: WorkChecks, ledger: Ledger, cfg: LedgerConfig, run_dir: Path) -> None:
    """Tie the checks to the opened ledger (cut back to the checkpoint a resume starts from): its run
    id, each key's node and the nonces its records used (`WorkChecks.take_up`), and copy the
    registered public keys into `<run>/work_keys/`, so the run's records can be checked later against
    the keys they were checked with (`python -m app.ledger verify`)."""
    checks.run = ledger.run_id
    if ledger.path.exists():
        checks.take_up(read_entries(ledger.path))
    out = Path(run_dir) / WORK_KEYS
    out.mkdir(exist_ok=True)
    for path in Path(cfg.work_keys or "").expanduser().glob(f"*{PUBLIC_SUFFIX}"):
        shutil.copyfile(path, out / path.name)


def with_nonces(checks: WorkChecks, prior: NodeConfig | None) -> NodeConfig:
    """The per-node task config `prior` plus the run and a fresh nonce for the task."""

    def per_node(node: int, connected: Any) -> dict[str, Any]:
        return {
            **(prior(node, connected) if prior is not None else {}),
            WORK_RUN: checks.run,
            WORK_NONCE: checks.issue(node),
        }

    return per_node


def reply_check(checks: WorkChecks) -> ReplyCheck:
    """The strategies' check of a training reply: its work record, against its own arrays."""

    def check(msg: Message, node: int) -> None:
        content = msg.content
        configs = records_of(content, ConfigRecord)
        arrays = list(records_of(content, ArrayRecord).values())
        digest = arrays_digest(arrays[0]) if len(arrays) == 1 else ""
        try:
            checks.check(dict(configs[WORK]) if WORK in configs else None, node, digest)
        except WorkRecordError as err:
            raise InvalidReply(f"work record: {err}") from None

    return check


def attach(checks: WorkChecks, nodes: list[dict[str, Any]]) -> None:
    """Put each verified record into its node's ledger record (`work`); records of nodes the entry
    does not list (a region's sites under FedBuff by region) are dropped, never carried over."""
    for record in nodes:
        if (work := checks.take(record["node_id"])) is not None:
            record["work"] = work
    checks.verified.clear()
