"""Write an offline text corpus for dataset=text: the dataset descriptions that ship with
scikit-learn (15 English documents, ~47 KB), so examples, tests and benchmarks need no download.

    python scripts/text_corpus.py --out /tmp/corpus            # one .txt per document (partition=by_file)
    python scripts/text_corpus.py --out /tmp/labelled --labelled   # texts.jsonl: sentences labelled by document
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from pathlib import Path


def documents() -> dict[str, str]:
    """{name: text} of scikit-learn's dataset descriptions (sklearn/datasets/descr/*.rst)."""
    import sklearn

    folder = Path(sklearn.__file__).parent / "datasets" / "descr"
    return {f.stem: f.read_text(encoding="utf-8") for f in sorted(folder.glob("*.rst"))}


def write_files(out: Path, names: Sequence[str] | None = None) -> list[Path]:
    """One `<name>.txt` per document (all, or `names`)."""
    out.mkdir(parents=True, exist_ok=True)
    docs = documents()
    paths = []
    for name in names or list(docs):
        path = out / f"{name}.txt"
        path.write_text(docs[name], encoding="utf-8")
        paths.append(path)
    return paths


def write_labelled(out: Path, names: Sequence[str], min_chars: int = 30) -> Path:
    """`texts.jsonl`: every sentence (or table line) of at least `min_chars` characters of the
    documents `names`, labelled with its document's index in `names`."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "texts.jsonl"
    docs = documents()
    with path.open("w", encoding="utf-8") as f:
        for label, name in enumerate(names):
            for line in re.split(r"(?<=[.!?])\s+|\n\s*\n", docs[name]):
                text = " ".join(line.split())
                if len(text) >= min_chars:
                    f.write(json.dumps({"text": text, "label": label}) + "\n")
    return path


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--labelled", action="store_true", help="texts.jsonl of labelled sentences instead")
    parser.add_argument("--names", nargs="*", help="documents to use (default: all; --labelled: four)")
    args = parser.parse_args(argv)
    if args.labelled:
        print(write_labelled(args.out, args.names or ["iris", "wine_data", "diabetes", "digits"]))
    else:
        for path in write_files(args.out, args.names):
            print(path)


if __name__ == "__main__":
    main()
