"""python -m app.ledger verify RUN_DIR [--public-key ledger.pub] [--work-keys DIR] | report RUN_DIR
| receipts RUN_DIR (--node ID | --check FILE) [--keep] | settle RUN_DIR --pool AMOUNT --rule RULE"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from app.ledger.chain import LEDGER_FILE, read_entries, verify_chain
from app.ledger.receipts import check_receipts, node_receipts, nodes_in, read_lines
from app.ledger.settle import RULES, SettlementError, write_settlement
from app.ledger.totals import write_report
from app.ledger.verify import verify_run


def receipts(run_dir: Path, node: int | None, check: Path | None, keep: bool) -> int:
    """Print a node's receipts from the ledger (the last reply's included) and, with `check`, what
    in the site's receipts file contradicts the ledger; exit status 1 on any problem."""
    entries = read_entries(Path(run_dir) / LEDGER_FILE)
    problems = [broken] if (broken := verify_chain(entries)) is not None else []
    lines = read_lines(check) if check is not None else []
    if node is None:
        found = nodes_in(lines)
        if len(found) != 1:
            print(f"ledger: name the node with --node (the file has {sorted(found) or 'no'} node ids)", file=sys.stderr)
            return 2
        (node,) = found
    held = node_receipts(entries, node)
    print(f"node {node}: {len(held)} recorded replies")
    print("| step | entry | reply sha256 | outcome |\n|---:|---|---|---|")
    for r in held:
        print(f"| {r['step']} | {r['hash']} | {r['reply_sha256']} | {r['outcome']} |")
    if held:
        last = held[-1]
        print(f"last reply: step {last['step']}, entry {last['hash']}, reply {last['reply_sha256']}")
    if check is not None:
        found, missing = check_receipts(entries, lines, node)
        problems += found
        for r in missing:
            print("receipt not in the file: " + json.dumps(r, sort_keys=True))
        if keep and missing:
            with Path(check).open("a") as f:
                for r in missing:
                    f.write(json.dumps({**r, "source": "ledger"}, sort_keys=True) + "\n")
            print(f"kept {len(missing)} receipts in {check}")
    for problem in problems:
        print(f"ledger: {problem}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.ledger", description="Check or total a run's ledger.jsonl.")
    parser.add_argument("command", choices=("verify", "report", "receipts", "settle"))
    parser.add_argument("run_dir", type=Path, help="the run's results directory (holds ledger.jsonl)")
    parser.add_argument("--public-key", type=Path, help="verify: the PEM public key ledger.sig must match")
    parser.add_argument("--node", type=int, help="receipts: the node id (else the one in --check's file)")
    parser.add_argument("--check", type=Path, help="receipts: the site's ledger-receipts-run<id>.jsonl to check")
    parser.add_argument("--keep", action="store_true", help="receipts: append the receipts --check's file lacks")
    parser.add_argument(
        "--work-keys", type=Path, help="verify: the sites' <site>.work.pub keys (default: the run's work_keys/)"
    )
    parser.add_argument("--pool", type=float, help="settle: the amount to pay out")
    parser.add_argument("--rule", choices=RULES, default="work", help="settle: what a step earns by (docs/ledger.md)")
    parser.add_argument("--blend", type=float, default=0.5, help="settle --rule blend: the work share (0-1)")
    args = parser.parse_args(argv)
    if args.command == "settle":
        if args.pool is None:
            parser.error("settle needs --pool AMOUNT")
        try:
            table, csv_path, json_path = write_settlement(args.run_dir, args.pool, args.rule, args.blend)
        except SettlementError as err:
            print(f"ledger: {err}", file=sys.stderr)
            return 1
        print(table)
        print(f"\nCSV: {csv_path}\nJSON: {json_path}")
        return 0
    if args.command == "receipts":
        if args.node is None and args.check is None:
            parser.error("receipts needs --node or --check")
        return receipts(args.run_dir, args.node, args.check, args.keep)
    if args.command == "verify":
        problems = verify_run(args.run_dir, args.public_key, args.work_keys)
        for problem in problems:
            print(f"ledger: {problem}", file=sys.stderr)
        if not problems:
            print(f"ledger OK: {args.run_dir}")
        return 1 if problems else 0
    table, csv_path, png = write_report(args.run_dir)
    print(table)
    print(f"\nCSV: {csv_path}\nplot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
