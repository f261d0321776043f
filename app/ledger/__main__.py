"""python -m app.ledger verify RUN_DIR [--public-key ledger.pub] | report RUN_DIR"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from app.ledger.report import write_report
from app.ledger.verify import verify_run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.ledger", description="Check or total a run's ledger.jsonl.")
    parser.add_argument("command", choices=("verify", "report"))
    parser.add_argument("run_dir", type=Path, help="the run's results directory (holds ledger.jsonl)")
    parser.add_argument("--public-key", type=Path, help="verify: the PEM public key ledger.sig must match")
    args = parser.parse_args(argv)
    if args.command == "verify":
        problems = verify_run(args.run_dir, args.public_key)
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
