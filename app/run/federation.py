"""The loops of a run: the synchronous rounds or FedBuff's asynchronous versions, central
evaluation, each step's records (row, ledger entry, checkpoint, live metrics) and the
stopping rules. Every part they work on is built beforehand by `app.run.assemble`.

Flower's `Strategy.start` cannot resume from a round, write a checkpoint between
rounds or stop at a target accuracy, so the loops live here; the synchronous one
drives any `RoundStrategy` through the same configure/aggregate calls, the asynchronous
one hands a `BufferStrategy` a callback for every server update.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from omegaconf import DictConfig

from app.config.schema import Config, ConfigError, check_columns
from app.ledger.chain import model_digest
from app.regions.traffic import wan_bytes
from app.run.arrivals import ReplyFacts, noted, pull_replies
from app.run.assemble import Run, assemble
from app.run.checkpoint import Checkpoint, capture_rng, save_checkpoint
from app.run.ledger_entries import attach_scores, round_nodes, secure_nodes, version_nodes, weighing
from app.run.results import read_summary
from app.run.rows import reply_metrics, reported, round_row, secure_row, secure_traffic, traffic, version_row
from app.run.work import attach
from app.secagg.server import Outcome
from app.task.training import evaluate
from strategies.central_dp import PrivacyBudgetExhausted
from strategies.fedbuff import VersionReport
from strategies.liveness import Stalled, StallWatch, tally
from strategies.node_names import labels
from strategies.node_wait import TooFewNodes
from strategies.replies import payload_bytes
from strategies.tensor_ops import record_to_tensors

log = logging.getLogger("flwr.fedgpu." + __name__)


def send_and_receive(
    grid: Grid, messages: Iterable[Message], timeout: float | None, max_poll_s: float = 0.2
) -> list[Message]:
    """Push `messages` and gather their replies (`pull_replies`) until all are in or `timeout`
    passes; the replies in the order their messages were sent."""
    ids = list(grid.push_messages(messages))
    order = {mid: i for i, mid in enumerate(ids)}
    replies = list(pull_replies(grid, ids, timeout, max_poll_s))
    # In the order sent, not the order of arrival: the aggregate's floating-point sum, and so
    # the run, is then the same however the replies were timed.
    return sorted(replies, key=lambda m: order.get(m.metadata.reply_to_message_id, len(order)))


class FederatedRun:
    """The loops over one assembled run (`app.run.assemble.Run`): the synchronous rounds or
    FedBuff's versions, central evaluation, each step's records, the stopping rules."""

    def __init__(self, run: Run) -> None:
        self.started = time.time()
        self.parts = run
        self.cfg, self.strategy, self.privacy = run.cfg, run.strategy, run.privacy
        self.recorder, self.monitor, self.ledger, self.scores = run.recorder, run.monitor, run.ledger, run.scores
        self.clock, self.task = run.clock, run.task
        self.status = run.status  # the MQTT status channel (monitoring.mqtt.host), or None
        self.stop_reason = "rounds"
        self.secure_outcome: Outcome | None = None  # the last secure round's (SecAgg+), until its row is written
        self.named_attackers: set[int] = set()  # malicious partitions whose node the log has named
        # The ledger's last model hash: each entry chains the model before and after its step.
        self.model_digest = model_digest(self.full_state(run.arrays)) if run.ledger is not None else ""

    @property
    def arrays(self) -> ArrayRecord:
        """The global model's trainable tensors."""
        return self.parts.arrays

    @arrays.setter
    def arrays(self, arrays: ArrayRecord) -> None:
        self.parts.arrays = arrays

    def full_state(self, arrays: ArrayRecord) -> dict[str, torch.Tensor]:
        return self.parts.model.full_state(arrays)

    def elapsed(self) -> float:
        return self.parts.elapsed_before + time.time() - self.started

    def budget_spent(self) -> str:
        """The stop reason once federation.max_wall_time_s is spent, on the run's clock."""
        kind = "simulated" if self.clock is not None else "wall-clock"
        return f"{kind} budget {self.cfg.federation.max_wall_time_s:.0f} s spent"

    def budget_time(self) -> float:
        """What federation.max_wall_time_s counts: simulated seconds on a virtual clock, else wall time."""
        return self.clock.now if self.clock is not None else self.elapsed()

    def central_eval(self, arrays: ArrayRecord) -> tuple[float, dict[str, float]]:
        """(loss, {metric: value}) of the model on the server's test split."""
        run = self.parts
        run.model.module.load_state_dict(self.full_state(arrays))
        return evaluate(run.model.module.to(run.device), run.test_data, run.precision, self.task)

    def record_scores(self, nodes: list[dict], scores: dict[int, float]) -> None:
        """Put the step's contribution scores into its ledger records, the totals into the metrics."""
        attach_scores(nodes, scores)
        assert self.scores is not None
        for node, total in self.scores.totals.items():
            self.monitor.contribution(node, total)

    @staticmethod
    def sim_note(row: dict[str, Any]) -> str:
        """The simulated time for a log line, on a virtual clock."""
        return f"  (simulated t={row['sim_time_s']:.1f}s)" if "sim_time_s" in row else ""

    def describe(self, loss: float | None, metrics: dict[str, float] | None) -> str:
        """The evaluation for a log line: the metrics, then the loss."""
        if metrics is None or loss is None:
            return "(not evaluated)"
        return "  ".join([*(f"{k} {v:.4f}" for k, v in metrics.items()), f"loss {loss:.4f}"])

    def evaluates(self, step: int) -> bool:
        """Whether `step` (a round, or a FedBuff version) is evaluated centrally: every
        federation.eval_every, the last, and the one that spends the wall-clock budget."""
        f = self.cfg.federation
        return (
            step % f.eval_every == 0
            or step >= f.rounds
            or bool(f.max_wall_time_s and self.budget_time() >= f.max_wall_time_s)
        )

    def should_stop(self, rnd: int, metrics: dict[str, float] | None) -> bool:
        """Rounds done, the target metric reached or wall-clock budget spent (sets stop_reason).
        validate() has resolved the target (federation.target_accuracy included)."""
        f = self.cfg.federation
        value = (metrics or {}).get(str(f.target_metric))
        if f.target_value and value is not None and value >= f.target_value:
            self.stop_reason = f"target {f.target_metric} {f.target_value} reached"
        elif f.max_wall_time_s and self.budget_time() >= f.max_wall_time_s:
            self.stop_reason = self.budget_spent()
        elif rnd >= f.rounds:
            self.stop_reason = "rounds"
        else:
            return False
        if self.stop_reason != "rounds":
            log.info("stopping after round %d: %s", rnd, self.stop_reason)
        return True

    def save_state(self, rnd: int, wall_time_s: float, state: dict[str, torch.Tensor] | None = None) -> None:
        """Checkpoint the model after `rnd` (`state`: the whole model, when the caller has built it)
        with the privacy spent so far: central DP's accountant is in the strategy's state, local
        DP's histories in the run's."""
        save_checkpoint(
            self.recorder.checkpoint_path,
            Checkpoint(
                state if state is not None else self.full_state(self.arrays),
                rnd,
                self.strategy.state_dict(),
                capture_rng(self.strategy.sampler),
                wall_time_s,
                run_state=self.privacy.state(),
            ),
        )

    def finish_round(
        self, rnd: int, row: dict[str, Any], nodes: list[dict[str, Any]], client_metrics: list[tuple[int, Any]]
    ) -> None:
        """Record step `rnd`: its ledger entry (`nodes`: who took part and how), the checkpoint, its
        row, and the live metrics (per node from `client_metrics` only where the row may be exact)."""
        row.update(self.privacy.row())
        if self.status is not None:  # what the channel handed over and dropped so far (a broker away)
            row["status_channel"] = self.status.counts()
        check_columns(row, self.task.names)
        self.name_attackers()
        if (described := self.privacy.describe(row)) is not None:
            log.info("[%s %d] privacy: %s", self.strategy.unit, rnd, described)
        state = self.full_state(self.arrays)  # hashed for the ledger and checkpointed: built once
        if self.ledger is not None:  # before the checkpoint: a resume drops entries past it
            self.parts.node_keys.name(nodes)
            if self.parts.work is not None:
                attach(self.parts.work, nodes)
            before, self.model_digest = self.model_digest, model_digest(state)
            entry = {"step": rnd, "unit": self.strategy.unit, "wall_time_s": row["wall_time_s"]}
            entry["weights"] = weighing(self.cfg)  # how `nodes` weigh: settlement reads it
            if "secagg" in row:  # a secure round: the survivors and the sums' hashes, no per-node weights
                entry["secagg"] = {k: row["secagg"][k] for k in ("survivors", "masked_sum_sha256", "sum_sha256")}
            self.ledger.append({**entry, "model_before": before, "model_after": self.model_digest, "nodes": nodes})
        # Checkpoint first: a row in metrics.jsonl then always means a resumable round.
        self.save_state(rnd, row["wall_time_s"], state)
        recorded = reported(row, self.privacy.exact_per_node, self.task.names)
        self.recorder.log_round(recorded)
        self.monitor.observe(recorded, client_metrics if self.privacy.exact_per_node else [])
        if self.status is not None:
            self.status.round_ended(recorded)

    def name_attackers(self) -> None:
        """Which nodes hold the malicious partitions, once their first claims have bound them
        (simulation; a deployment binds none), each named once."""
        holders = {p: self.parts.partitions.holder(p) for p in self.parts.attacked if p not in self.named_attackers}
        found = {p: node for p, node in holders.items() if node is not None}
        if found:
            self.named_attackers |= found.keys()
            log.info("attack %s: malicious nodes %s", self.cfg.attack.name, labels(found.values(), self.parts.names))

    @staticmethod
    def cohort(row: dict[str, Any]) -> str:
        """A round line's counts. A plain mean uses every reply it accepts: `clients` (accepted, and
        used) and `rejected`. A robust rule uses the ones it selects among them, so its line counts
        the replies received, accepted, selected (0 when the round was skipped) and rejected apart.
        `missing`: tasks sent without a reply, when there are any."""
        rejected, missing = row["num_rejected"], row["num_missing"]
        tail = f"  rejected {rejected}" + (f"  missing {missing}" if missing else "")
        if row["robust"] is None:
            return f"clients {row['num_clients']}{tail}"
        replies = row["num_sampled"] - missing
        selected = row["num_clients"] if row["model_updated"] else 0
        return f"replies {replies}  accepted {replies - rejected}  selected {selected}{tail}"

    def timed_row(
        self, rnd: int, metrics: dict[str, float] | None, loss: float | None, step_s: float
    ) -> dict[str, Any]:
        """The columns every row starts with: each metric by its name (None when not evaluated)."""
        return {
            "round": rnd,
            **(metrics if metrics is not None else dict.fromkeys(self.task.names)),
            "loss": loss,
            "wall_time_s": self.elapsed(),
            "round_time_s": step_s,
            **({"sim_time_s": self.clock.now} if self.clock is not None else {}),
        }

    def region_of(self, node: int) -> int | None:
        """The region of a simulated node, once its partition is bound (sites placed in regions)."""
        placed = self.parts.region_of_partition
        partition = self.parts.partitions.partition_of(node)
        return placed[partition] if placed is not None and partition is not None else None

    def wide_area(
        self, sent: list[tuple[int, int]], received: list[tuple[int, int]], evaluation: bool = False
    ) -> dict[str, Any]:
        """With the sites in regions: the round's bytes over the WAN links (`wan_bytes`), from each
        task's and reply's (node, bytes), and, under topology=regions, each region's part
        (`regions`); on a virtual clock the regions' updates (`evaluation`: their metrics, no
        arrays) then cross their WAN links back (`finish_regions`). Nothing without regions."""
        if self.parts.region_of_partition is None:
            return {}
        combine = self.parts.regions
        hierarchical = self.cfg.topology.name == "regions"
        total, up = wan_bytes(
            self.region_of,
            sent,
            received,
            ({} if evaluation or combine is None else combine.wan_bytes_up()) if hierarchical else None,
        )
        if self.clock is not None and hierarchical:
            self.clock.finish_regions(up)
        if not hierarchical or evaluation:
            return {"wan_bytes": total}
        if combine is None:  # central DP: one sum of clipped updates, no regional outcome to report
            return {"wan_bytes": total}
        regions = combine.row()
        for region, entry in regions.items():
            entry["wan_bytes_up"] = up.get(int(region), 0)
        return {"wan_bytes": total, "regions": regions}

    # --- synchronous rounds ------------------------------------------------------
    def exchange(self, messages: list[Message], timeout: float | None) -> list[Message]:
        """Send a round's tasks and collect the replies within the round timeout (simulated
        seconds on a virtual clock, where a late reply is dropped as missing)."""
        if self.clock is not None:
            return self.clock.send_and_receive(messages, timeout=timeout)
        return send_and_receive(self.parts.grid, messages, timeout)

    def arrivals(self, messages: list[Message], timeout: float | None) -> Iterator[Message]:
        """Send a round's tasks and yield each reply as it arrives, keeping none (a streamed round).
        A virtual clock orders replies by simulated finish time, so it holds the round's replies
        until its slowest node finishes; they are then handed on one at a time and dropped."""
        if self.clock is not None:
            replies = deque(self.clock.send_and_receive(messages, timeout=timeout))
            while replies:
                yield replies.popleft()
            return
        grid = self.parts.grid
        yield from pull_replies(grid, list(grid.push_messages(messages)), timeout)

    def train(
        self, rnd: int, messages: list[Message], timeout: float | None
    ) -> tuple[ArrayRecord | None, MetricRecord | None, list[ReplyFacts]]:
        """A round's new model, its training metrics and the facts of its replies: gathered (all
        replies, summed in send order), with `Run.streams` folded as they arrive, or under secure
        aggregation the facts of the masked replies (the round's stages: `secure_round`)."""
        digest = self.ledger is not None
        if getattr(self.strategy, "secure", False):
            new, metrics, outcome = self.strategy.secure_train(  # type: ignore[attr-defined] - SecureFedAvg
                rnd,
                messages,
                lambda stage: self.arrivals(stage, timeout),
                self.clock.side_by_side if self.clock is not None else None,
            )
            self.secure_outcome = outcome
            return new, metrics, [ReplyFacts.of(r, False) for r in outcome.masked]  # arrays gone: summed
        if self.parts.streams:
            facts: list[ReplyFacts] = []
            new, metrics = self.strategy.aggregate_stream(rnd, noted(self.arrivals(messages, timeout), facts, digest))
            return new, metrics, facts
        replies = self.exchange(messages, timeout)
        new, metrics = self.strategy.aggregate_train(rnd, replies)
        return new, metrics, [ReplyFacts.of(r, digest) for r in replies]

    def run_rounds(self) -> None:
        strategy, grid, cfg = self.strategy, self.parts.grid, self.cfg
        timeout = cfg.federation.round_timeout_s
        federated_eval = cfg.federation.fraction_evaluate > 0
        stall = StallWatch(cfg.federation.stall_rounds, last=self.parts.first_round - 1)
        for rnd in range(self.parts.first_round, cfg.federation.rounds + 1):
            t0 = time.time()
            if self.status is not None:
                self.status.round_begun(rnd)
            config = ConfigRecord(self.parts.client_config)
            messages = list(strategy.configure_train(rnd, self.arrays, config, grid))
            previous = self.arrays
            new_arrays, train_metrics, replies = self.train(rnd, messages, timeout)
            secure = self.secure_outcome
            if secure is None:
                sent = [(m.metadata.dst_node_id, payload_bytes(m.content)) for m in messages]
                received = [(r.src_node_id, r.payload_bytes) for r in replies if r.error is None]
            else:  # each node's four stages; the masked replies' arrays are gone (summed)
                sent, received = list(secure.bytes_down.items()), list(secure.bytes_up.items())
            wide_area = self.wide_area(sent, received)
            client_metrics = reply_metrics(replies)
            self.privacy.record_spending(client_metrics)
            if self.privacy.spent_before_release(federated_eval):
                # Spending that has left the server goes on record before anything else can crash:
                # the previous model with this round's spending, so a crash before the round's own
                # checkpoint re-runs the round, charged twice, never zero times.
                self.save_state(rnd - 1, self.elapsed())
            report = strategy.train_report
            if new_arrays is not None:
                self.arrays = new_arrays
            fed_eval: MetricRecord | None = None
            tasks = list(messages) if secure is None else list(secure.sent)
            if federated_eval:
                eval_msgs = list(
                    strategy.configure_evaluate(rnd, self.arrays, ConfigRecord(self.parts.client_config), grid)
                )
                fed_eval = strategy.aggregate_evaluate(rnd, self.exchange(eval_msgs, timeout))
                tasks += eval_msgs
                if wide_area:  # the model down to each region again, metrics back
                    wide_area["wan_bytes"] += self.wide_area(
                        [(m.metadata.dst_node_id, payload_bytes(m.content)) for m in eval_msgs], [], evaluation=True
                    )["wan_bytes"]
            loss, metrics = self.central_eval(self.arrays) if self.evaluates(rnd) else (None, None)
            row = {
                **self.timed_row(rnd, metrics, loss, time.time() - t0),
                **round_row(
                    rnd,
                    report,
                    len(replies) if secure is None else report.sampled,
                    client_metrics,
                    strategy.robust_row(),
                    new_arrays is not None,
                    train_metrics,
                    fed_eval,
                ),
                **(
                    traffic(
                        [payload_bytes(m.content) for m in tasks],
                        [r.payload_bytes for r in replies if r.error is None],
                        self.parts.unpack.take() if self.parts.unpack is not None else None,
                    )
                    if secure is None
                    else secure_traffic(secure, tasks[len(secure.sent) :])
                ),
                **({"secagg": secure_row(secure, self.strategy.sum_digest)} if secure is not None else {}),
                **wide_area,
            }
            nodes = (
                round_nodes(messages, replies, report, cfg.strategy.name, weighing(cfg))
                if secure is None
                else secure_nodes(messages, secure)
            )
            self.secure_outcome = None
            if self.scores is not None:
                self.record_scores(
                    nodes, self.scores.score(record_to_tensors(previous), strategy.last_valid, strategy.robust_row())
                )
            self.finish_round(rnd, row, nodes, client_metrics)
            log.info(
                "[round %d/%d] %s  %.1fs%s  %s",
                rnd,
                cfg.federation.rounds,
                self.describe(loss, metrics),
                row["round_time_s"],
                self.sim_note(row),
                self.cohort(row),
            )
            if self.should_stop(rnd, metrics):
                break
            outcomes = tally([r["reason"] for r in row["rejected"]], missing=row["num_missing"])
            stall.round_ended(rnd, new_arrays is not None, outcomes)  # Stalled after stall_rounds without one

    # --- asynchronous versions (FedBuff) ---------------------------------------------
    def run_versions(self) -> None:
        strategy, cfg = self.strategy, self.cfg
        budget = cfg.federation.max_wall_time_s
        last = time.time()

        def on_version(report: VersionReport, arrays: ArrayRecord) -> bool:
            nonlocal last
            self.privacy.record_spending(report.client_metrics)
            self.arrays = arrays
            v = report.version
            loss, metrics = self.central_eval(arrays) if self.evaluates(v) else (None, None)
            now = time.time()
            row = {
                **self.timed_row(v, metrics, loss, now - last),
                **version_row(report, strategy.tasks_sent),
                **traffic(
                    report.bytes_down,
                    report.bytes_up,
                    self.parts.unpack.take() if self.parts.unpack is not None else None,
                ),
                # sites in regions: every transfer of a version crosses a WAN link (a site's under flat,
                # a region's own under topology=regions, whose tasks and replies are the regions')
                **(
                    {"wan_bytes": sum(report.bytes_down) + sum(report.bytes_up)}
                    if self.parts.region_of_partition is not None
                    else {}
                ),
            }
            last = now
            nodes = version_nodes(report, cfg.strategy.buffer_aggregator, weighing(cfg))
            if self.scores is not None:
                scores = self.scores.score_buffer(
                    strategy.last_base, strategy.last_buffer, strategy.server_lr, report.robust
                )
                self.record_scores(nodes, scores)
            self.finish_round(v, row, nodes, report.client_metrics)
            log.info(
                "[version %d/%d] %s  %.1fs%s  staleness %s  discarded %d  rejected %d  failed %d",
                v,
                cfg.federation.rounds,
                self.describe(loss, metrics),
                row["round_time_s"],
                self.sim_note(row),
                row["staleness"],
                report.discarded_stale,
                len(report.rejected),
                len(report.failed),
            )
            return self.should_stop(v, metrics)

        clock = (lambda: self.clock.now) if self.clock is not None else time.monotonic
        deadline = clock() + budget - self.budget_time() if budget else None
        try:
            self.arrays = strategy.run(
                self.parts.grid,
                self.arrays,
                self.parts.client_config,
                on_version,
                first_version=self.parts.first_round - 1,
                deadline=deadline,
                drain=self.privacy.drain,
                clock=clock,
            )
        except Stalled:
            self.record_unversioned()
            raise
        self.record_unversioned()
        if deadline is not None and clock() >= deadline:
            self.stop_reason = self.budget_spent()

    def record_unversioned(self) -> None:
        """Replies after the last version (and the tasks still out at the stop, drained) spent their
        steps too (local DP): on record and checkpointed."""
        strategy = self.strategy
        if self.privacy.drain and strategy.report.client_metrics:
            self.privacy.record_spending(strategy.report.client_metrics)
            self.save_state(strategy.version, self.elapsed())

    def final_evaluation(self) -> dict[str, Any]:
        """The final model's metrics when the last row did not evaluate it.

        A run can stop between evaluations (`federation.eval_every` > 1, e.g. at a
        wall-clock budget) or, with FedBuff, before its first version (a budget spent on
        the first tasks); it still reports the model it ends with, the initial one if
        nothing was applied.
        """
        rows, primary = self.recorder.rows, self.task.primary
        if rows and rows[-1].get(primary) is not None:
            return {}
        loss, metrics = self.central_eval(self.arrays)
        log.info("final model, not evaluated by the last recorded step: %s", self.describe(loss, metrics))
        accuracy = {"final_accuracy": metrics["accuracy"]} if "accuracy" in metrics else {}
        return {"final_metric": metrics[primary], **accuracy, "final_loss": loss}

    def export_hf(self) -> list[Path]:
        """model=hf: the final model as transformers directories under `<run>/hf/` (the adapter
        and the merged model), loadable without this app. Last: merging changes the module."""
        from app.task.hf import export

        module = self.parts.model.module
        module.load_state_dict(self.full_state(self.arrays))
        paths = export(module.cpu(), self.cfg.model, self.recorder.run_dir / "hf")
        log.info("final model as transformers directories: %s", ", ".join(map(str, paths)))
        return paths

    def serve_metrics(self) -> None:
        """Start the Prometheus endpoint (monitoring.prometheus_port > 0) before the first step."""
        m = self.cfg.monitoring
        if not m.prometheus_port:
            return
        try:
            port = self.monitor.start(m.prometheus_port, m.prometheus_host)
        except OSError as err:
            raise ConfigError(
                f"monitoring.prometheus_port={m.prometheus_port}: cannot serve on {m.prometheus_host} ({err}); "
                "pick a free port"
            ) from None
        log.info("Prometheus metrics: http://%s:%d/metrics", m.prometheus_host, port)

    def run(self) -> dict[str, Any]:
        status = "failed"
        try:
            try:
                self.serve_metrics()
                if self.status is not None:
                    self.status.started(strategy=self.cfg.strategy.name, steps=self.cfg.federation.rounds)
                self.run_versions() if self.strategy.asynchronous else self.run_rounds()
            except PrivacyBudgetExhausted as err:
                self.stop_reason = str(err)
                log.warning("stopping: %s; the saved model is the last one released within the budget", err)
            except (TooFewNodes, Stalled) as err:  # resumable: the summary says stopped, not completed
                status, self.stop_reason = "stopped", str(err)
                raise
            status = "completed"
        finally:
            self.monitor.close()
            if self.status is not None:
                failure = sys.exc_info()[1]
                self.status.stopped(
                    status, self.stop_reason if failure is None else f"{type(failure).__name__}: {failure}"
                )
                self.status.close()
            torch.save(self.full_state(self.arrays), self.recorder.final_model_path)
            cfg = self.cfg
            extra: dict[str, Any] = {
                "strategy": cfg.strategy.name,
                "dataset": cfg.dataset.name,
                "model": cfg.model.name,
                "num_nodes": len(self.parts.nodes),
                "stop_reason": self.stop_reason if status in ("completed", "stopped") else None,
                "attack": {**asdict(cfg.attack), "malicious_partitions": self.parts.attacked},
                **({"fleet": self.parts.fleet} if self.parts.fleet is not None else {}),
                "privacy": self.privacy.summary(),
                "final_model": str(self.recorder.final_model_path),
                "checkpoint": str(self.recorder.checkpoint_path),
                **self.strategy.run_summary(),
            }
            if self.ledger is not None:
                self.ledger.seal(status)  # the signature now says the run ended here (app/ledger/signing.py)
                extra["ledger"] = {
                    "file": str(self.ledger.path),
                    "entries": self.ledger.length,
                    "head": self.ledger.head,
                }
                log.info("ledger: %d entries, head %s", self.ledger.length, self.ledger.head)
            if status == "completed":
                extra.update(self.final_evaluation())
            if cfg.model.name == "hf":
                extra["final_model_hf"] = [str(p) for p in self.export_hf()]
            summary = self.recorder.finish(status, self.elapsed(), extra)
            log.info(
                "run %s: final %s %s, results: %s",
                status,
                summary["primary_metric"],
                summary["final_metric"],
                self.recorder.run_dir,
            )
        return summary


def completed_run(cfg: Config, root: Path) -> dict[str, Any] | None:
    """With `resume=auto`, the named run's summary when it has already finished what this config
    asks (its rounds, or its target or budget): re-running the same command is then a no-op."""
    if cfg.resume != "auto":
        return None
    summary = read_summary(root / str(cfg.name))
    if not summary or summary.get("status") != "completed":
        return None
    done = (
        summary.get("stop_reason") not in (None, "rounds")
        or summary.get("rounds_completed", 0) >= cfg.federation.rounds
    )
    return summary if done else None


def run_federation(grid: Grid, cfg: Config, raw: DictConfig, root: Path) -> dict[str, Any]:
    """Train for `federation.rounds` rounds or versions (or the rest of them after `resume`);
    with `resume=auto` and the run already complete, say so and return its summary."""
    if (summary := completed_run(cfg, root)) is not None:
        log.info(
            "run %r already complete (stop reason: %s, %s steps): nothing to do; results: %s",
            cfg.name,
            summary.get("stop_reason"),
            summary.get("rounds_completed"),
            root / str(cfg.name),
        )
        return summary
    return FederatedRun(assemble(grid, cfg, raw, root)).run()
