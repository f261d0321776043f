"""Text data (`dataset=text`): a site's own `.txt` / `.jsonl` files or a saved Hugging Face
dataset with a text column, tokenized once per node (and cached on disk) into token blocks.

What a `TextSource` holds, per task type:
- causal_lm: blocks of `dataset.block_size` tokens (`x`) and their next tokens (`labels`,
  N x T). Each file's tokens are packed end to end into windows of T + 1 that overlap by one
  token, so every token but a file's first is predicted exactly once; a file's tail shorter
  than a window is dropped. No block needs padding, so every example weighs the same.
- sequence_classification: one row per text, truncated to T tokens and padded with -1 (the
  model turns -1 into its pad token and masks it: `app/task/hf.py`), and the text's label.

`groups` is the file each example came from: `partition=by_file` gives each file to one
partition (the natural split of sites' corpora).
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from app.config.schema import ConfigError, DatasetConfig, ModelConfig
from app.task.data import DatasetUnavailableError, holdout_split, targets

log = logging.getLogger("flwr.fedgpu." + __name__)

TEXT_SUFFIXES = (".txt", ".jsonl")
PAD = -1  # a padded position of a token row (sequence_classification)


@dataclass
class Texts:
    """Raw texts before tokenization: the texts, their labels (None without), their files."""

    texts: list[str]
    labels: list[int] | None
    groups: np.ndarray  # the index of each text's file (or 0 for a saved dataset)
    files: list[str]


def _read_jsonl(path: Path, text_key: str, label_key: str) -> tuple[list[str], list[Any]]:
    texts, labels = [], []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetUnavailableError(
                    f"{path}:{n}: not JSON ({err.msg}); .jsonl holds one object a line"
                ) from err
            if not isinstance(row, dict) or not isinstance(row.get(text_key), str):
                raise DatasetUnavailableError(
                    f"{path}:{n}: no string field {text_key!r} (dataset.text_key); the line has {sorted(row)[:8]}"
                    if isinstance(row, dict)
                    else f"{path}:{n}: a JSON {type(row).__name__}, not an object"
                )
            texts.append(row[text_key])
            labels.append(row.get(label_key))
    return texts, labels


def text_files(path: str) -> list[Path]:
    """The .txt / .jsonl files at `path` (a file, or a directory's files, sorted by name)."""
    p = Path(path).expanduser()
    if p.is_file():
        if p.suffix not in TEXT_SUFFIXES:
            raise DatasetUnavailableError(
                f"dataset.path={path}: a {p.suffix or 'suffixless'} file; expected .txt or .jsonl"
            )
        return [p]
    if not p.is_dir():
        raise DatasetUnavailableError(f"dataset.path={path} does not exist (a .txt / .jsonl file or a directory)")
    files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in TEXT_SUFFIXES)
    if not files:
        raise DatasetUnavailableError(f"dataset.path={path}: no .txt or .jsonl file in the directory")
    return files


def read_texts(cfg: DatasetConfig, path: str) -> Texts:
    """The texts under `path`: .txt / .jsonl files (a .txt file is one text, for causal LM), or a
    `save_to_disk` directory (a Dataset or a DatasetDict's train split) with `dataset.text_key`."""
    p = Path(path).expanduser()
    if p.is_dir() and any((p / name).exists() for name in ("dataset_info.json", "dataset_dict.json")):
        return _read_saved(cfg, p)
    texts: list[str] = []
    labels: list[Any] = []
    groups: list[int] = []
    files = text_files(path)
    for i, f in enumerate(files):
        if f.suffix == ".jsonl":
            t, lab = _read_jsonl(f, cfg.text_key, cfg.label_key)
        else:
            t, lab = [f.read_text(encoding="utf-8")], [None]
        texts += t
        labels += lab
        groups += [i] * len(t)
    return Texts(
        texts, _labels(labels, str(path), cfg.label_key), np.asarray(groups, dtype=np.int64), [str(f) for f in files]
    )


def _read_saved(cfg: DatasetConfig, path: Path) -> Texts:
    import datasets

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DatasetUnavailableError(f"{path} has splits {list(loaded)}, needs 'train'")
        loaded = loaded["train"]
    if cfg.text_key not in loaded.column_names:
        raise DatasetUnavailableError(
            f"{path}: no column {cfg.text_key!r} (dataset.text_key); columns: {loaded.column_names}"
        )
    texts = list(loaded[cfg.text_key])
    labels = list(loaded[cfg.label_key]) if cfg.label_key in loaded.column_names else [None] * len(texts)
    return Texts(texts, _labels(labels, str(path), cfg.label_key), np.zeros(len(texts), dtype=np.int64), [str(path)])


def _labels(labels: list[Any], where: str, key: str) -> list[int] | None:
    """Whole-number labels for every text, or None when no text has one."""
    if all(v is None for v in labels):
        return None
    if any(v is None for v in labels):
        raise DatasetUnavailableError(f"{where}: some texts have a {key!r} (dataset.label_key) and some do not")
    return [int(v) for v in targets(np.asarray(labels), f"{where}: {key!r}")]


CACHE_FORMAT = 2  # bump when what a cache entry holds, or how rows are made, changes


def tokenizer_digest(tokenizer: Any) -> str:  # noqa: ANN401
    """The whole tokenizer, as `save_pretrained` writes it (vocabulary, merges, normalizer,
    special and added tokens, settings): two tokenizers that split any text differently differ
    here. Costs milliseconds; tokenizing a corpus costs seconds."""
    h = hashlib.blake2b(digest_size=16)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        for f in sorted(Path(tmp).rglob("*")):
            if f.is_file():
                h.update(f.relative_to(tmp).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return f"{type(tokenizer).__name__}:{h.hexdigest()}"


def _digest(texts: Texts, tokenizer: Any, cfg: DatasetConfig, causal: bool) -> str:  # noqa: ANN401
    """Everything a token cache entry's rows depend on: the texts, their labels, which file each
    came from, the whole tokenizer, the block size, the task and the cache format."""
    h = hashlib.blake2b(digest_size=16)
    for t in texts.texts:
        h.update(t.encode("utf-8", "surrogatepass") + b"\0")
    labels = "none" if texts.labels is None else json.dumps(texts.labels)
    h.update(f"labels|{labels}|".encode())
    h.update(np.ascontiguousarray(texts.groups, dtype=np.int64).tobytes())
    h.update(f"|{tokenizer_digest(tokenizer)}|{cfg.block_size}|{causal}|{CACHE_FORMAT}".encode())
    return h.hexdigest()


def _cache_problem(arrays: dict[str, np.ndarray], texts: Texts, vocab: int, block: int, causal: bool) -> str | None:
    """Why cached arrays cannot be what tokenizing `texts` gives (None when they can): names,
    dtypes, shapes, token ids within the vocabulary, labels and files those of the texts. A cache
    entry is a file anyone with the directory can replace; it must not bypass these checks."""
    if set(arrays) != {"x", "y", "groups"}:
        return f"holds {sorted(arrays)}, not x, y, groups"
    x, y, groups = arrays["x"], arrays["y"], arrays["groups"]
    if any(a.dtype != np.int64 for a in (x, y, groups)):
        return f"dtypes {x.dtype}, {y.dtype}, {groups.dtype}, not int64"
    n = len(x)
    if x.ndim != 2 or x.shape[1] != block or groups.shape != (n,):
        return f"shapes {x.shape}, {groups.shape} for blocks of {block}"
    if causal:
        if y.shape != x.shape or n == 0:
            return f"next tokens of shape {y.shape} for blocks {x.shape}"
        if x.min() < 0 or max(int(x.max()), int(y.max())) >= vocab or y.min() < 0:
            return f"token ids outside [0, {vocab})"
    else:
        if y.shape != (n,) or n != len(texts.texts):
            return f"{y.shape} labels for {len(texts.texts)} texts"
        if ((x < 0) & (x != PAD)).any() or int(x.max(initial=0)) >= vocab:
            return f"token ids outside [0, {vocab}) (or the pad {PAD})"
        if texts.labels is None or not np.array_equal(y, np.asarray(texts.labels, dtype=np.int64)):
            return "labels other than the texts'"
    if not np.isin(groups, texts.groups).all():
        return "files the texts do not come from"
    return None


def tokenize(texts: Texts, tokenizer: Any, cfg: DatasetConfig, causal: bool) -> dict[str, np.ndarray]:  # noqa: ANN401
    """Token arrays `x`, `y`, `groups` (see the module docstring), from the cache in
    `dataset.cache_dir` when these texts were tokenized the same way before: a deployed node
    starts a fresh ClientApp process for every message, and tokenizing a corpus costs seconds."""
    cache = (
        Path(cfg.cache_dir).expanduser() / f"{_digest(texts, tokenizer, cfg, causal)}.npz" if cfg.cache_dir else None
    )
    if cache is not None and cache.is_file():
        try:
            with np.load(cache, allow_pickle=False) as f:
                cached = {k: f[k] for k in f.files}
            problem = _cache_problem(cached, texts, len(tokenizer), cfg.block_size, causal)
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
            problem = f"unreadable ({err})"
        if problem is None:
            return cached
        log.warning("token cache %s: %s; tokenizing again and replacing it", cache, problem)
    out = _blocks(texts, tokenizer, cfg.block_size) if causal else _rows(texts, tokenizer, cfg.block_size)
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{np.random.default_rng().integers(1 << 30)}.tmp.npz")
        np.savez(tmp, **out)
        tmp.replace(cache)  # atomic: nodes sharing a cache never read half a file
    return out


def _blocks(texts: Texts, tokenizer: Any, block: int) -> dict[str, np.ndarray]:  # noqa: ANN401
    """Causal LM: each file's texts joined (with the end-of-text token between them when the
    tokenizer has one), cut into windows of block + 1 tokens."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    xs, ys, groups = [], [], []
    for g in np.unique(texts.groups):
        ids: list[int] = []
        for i in np.flatnonzero(texts.groups == g):
            ids += tokenizer(texts.texts[i], add_special_tokens=False)["input_ids"] + eos
        n = (len(ids) - 1) // block
        if n == 0:
            continue
        arr = np.asarray(ids[: n * block + 1], dtype=np.int64)
        xs.append(arr[:-1].reshape(n, block))
        ys.append(arr[1:].reshape(n, block))
        groups.append(np.full(n, g, dtype=np.int64))
    if not xs:
        raise DatasetUnavailableError(
            f"no text has more than dataset.block_size={block} tokens: lower dataset.block_size or add text"
        )
    return {"x": np.concatenate(xs), "y": np.concatenate(ys), "groups": np.concatenate(groups)}


def _rows(texts: Texts, tokenizer: Any, block: int) -> dict[str, np.ndarray]:  # noqa: ANN401
    """Sequence classification: one row per text, at most `block` tokens, padded with PAD."""
    if texts.labels is None:
        raise DatasetUnavailableError(
            f"task.type=sequence_classification needs a label per text (field {texts.files[0]}: dataset.label_key)"
        )
    x = np.full((len(texts.texts), block), PAD, dtype=np.int64)
    for i, t in enumerate(texts.texts):
        ids = tokenizer(t, truncation=True, max_length=block)["input_ids"]
        x[i, : len(ids)] = ids
    return {"x": x, "y": np.asarray(texts.labels, dtype=np.int64), "groups": texts.groups}


@dataclass
class TextSource:
    """Token rows in memory (a `Source` of `app.task.data`), with each row's file."""

    x: np.ndarray
    labels: np.ndarray  # N x T next tokens (causal_lm) or N labels
    groups: np.ndarray

    def inputs(self, idx: np.ndarray) -> np.ndarray:
        return self.x[idx]

    def subset(self, idx: np.ndarray) -> TextSource:
        return TextSource(self.x[idx], self.labels[idx], self.groups[idx])


def text_source(cfg: DatasetConfig, model: ModelConfig, causal: bool, path: str | None = None) -> TextSource:
    """The tokenized texts at `path` (default `dataset.path`) with the model's tokenizer."""
    from app.task.hf import load_tokenizer  # transformers: imported only for text

    where = path or cfg.path
    if not where:
        raise ConfigError(
            "dataset=text needs dataset.path (a .txt / .jsonl file, a directory of them, or a saved dataset)"
        )
    arrays = tokenize(read_texts(cfg, where), load_tokenizer(model), cfg, causal)
    return TextSource(arrays["x"], arrays["y"], arrays["groups"])


def text_splits(cfg: DatasetConfig, model: ModelConfig, causal: bool, seed: int) -> tuple[TextSource, TextSource]:
    """(train, test): a seeded hold-out of `dataset.test_fraction` of the rows."""
    full = text_source(cfg, model, causal)
    if len(full.labels) < 2:
        raise DatasetUnavailableError(
            f"dataset.path={cfg.path}: {len(full.labels)} example(s) after tokenizing; need 2 or more"
        )
    train_idx, test_idx = holdout_split(len(full.labels), cfg.test_fraction, seed)
    return full.subset(train_idx), full.subset(test_idx)


def by_file(groups: np.ndarray, num_partitions: int, partition_id: int) -> np.ndarray:
    """`partition=by_file`: the rows of the files dealt to this partition (file i to partition
    i mod num_partitions): exactly one file each when there are as many files as partitions."""
    files = np.unique(groups)
    if len(files) < num_partitions:
        raise ConfigError(
            f"partition=by_file gives each partition whole files, but the data has {len(files)} file(s) for "
            f"{num_partitions} partitions: add files, use fewer nodes, or partition=iid"
        )
    mine = files[partition_id::num_partitions]
    return np.flatnonzero(np.isin(groups, mine))


def write_jsonl(path: Path, x: np.ndarray, y: np.ndarray, model: ModelConfig, cfg: DatasetConfig, causal: bool) -> None:
    """Token rows back as a .jsonl of texts (`dataset.text_key`, and `dataset.label_key` for
    classification): a partition a deployed node reads with dataset=text (scripts/export_partitions.py).
    A causal-LM block is written with its last next token, so the text is the whole window."""
    from app.task.hf import load_tokenizer

    tokenizer = load_tokenizer(model)
    with path.open("w", encoding="utf-8") as f:
        for row, target in zip(x, y, strict=True):
            ids = np.append(row, target[-1]) if causal else row[row != PAD]
            # A row's special tokens come back when the node tokenizes it; a block's end-of-text
            # tokens between texts are content.
            line = {cfg.text_key: tokenizer.decode(ids.tolist(), skip_special_tokens=not causal)}
            if not causal:
                line[cfg.label_key] = int(target)
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
