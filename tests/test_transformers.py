"""Transformers as models (model=hf), text data (dataset=text) and LoRA adapters (issue 35).

Models are built from a config (conf/model/hf_tiny.yaml) and tokenized with ByT5's byte
tokenizer, so nothing is downloaded; the corpus is scikit-learn's dataset descriptions
(scripts/text_corpus.py)."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import Message

from app.config.compose import load_config
from app.config.schema import ConfigError, DatasetConfig, ModelConfig, PartitionConfig, TaskConfig
from app.protocol import ARRAYS, BASE_DIGEST
from app.task.data import DataSpec, Examples, partition_indices
from app.task.hf import base_digest, check_base, hf_model, load_tokenizer
from app.task.metrics import LanguageModelTask, Task
from app.task.text import read_texts, text_source, tokenize
from app.task.training import evaluate, resolve_precision
from app.tools.in_process import run_in_process

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from text_corpus import write_files, write_labelled  # noqa: E402

DOCS = ["iris", "wine_data", "diabetes", "digits"]
LM = "model=hf_tiny task=causal_lm dataset=text dataset.block_size=64 partition=by_file train.epochs=1 train.optimizer=adamw"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("corpus")
    write_files(out, DOCS)
    return out


@pytest.fixture(scope="module")
def labelled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("labelled")
    write_labelled(out, DOCS)
    return out


def _lm_config(corpus: Path, extra: str = "") -> tuple:
    cfg, _ = load_config(f"{LM} dataset.path={corpus} dataset.cache_dir=null {extra}")
    return cfg


def test_causal_blocks_predict_every_token_once_and_never_across_files(corpus: Path) -> None:
    cfg = DatasetConfig(name="text", path=str(corpus), block_size=16, cache_dir=None)
    texts = read_texts(cfg, str(corpus))
    tok = load_tokenizer(ModelConfig(name="hf"))
    arrays = tokenize(texts, tok, cfg, causal=True)
    x, y, groups = arrays["x"], arrays["y"], arrays["groups"]
    assert x.shape == y.shape and x.shape[1] == 16
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
    for g, f in enumerate(texts.files):  # a file's blocks, joined, are its tokens in order
        ids = tok(Path(f).read_text(), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows = np.flatnonzero(groups == g)
        joined = np.concatenate([x[rows].reshape(-1), y[rows][-1:, -1]])
        np.testing.assert_array_equal(joined, ids[: len(joined)])
        assert len(ids) - len(joined) < 16  # only a tail shorter than a block is dropped


def test_tokens_are_cached_and_the_cache_is_what_tokenizing_gives(corpus: Path, tmp_path: Path, monkeypatch) -> None:
    cfg = DatasetConfig(name="text", path=str(corpus), block_size=32, cache_dir=str(tmp_path))
    first = text_source(cfg, ModelConfig(name="hf"), causal=True)
    assert len(list(tmp_path.glob("*.npz"))) == 1
    import app.task.text as text

    monkeypatch.setattr(text, "_blocks", lambda *a: pytest.fail("tokenized again despite the cache"))
    again = text_source(cfg, ModelConfig(name="hf"), causal=True)
    np.testing.assert_array_equal(first.x, again.x)
    np.testing.assert_array_equal(first.labels, again.labels)


def test_by_file_gives_each_partition_one_whole_file(corpus: Path) -> None:
    cfg = DatasetConfig(name="text", path=str(corpus), block_size=32, cache_dir=None)
    src = text_source(cfg, ModelConfig(name="hf"), causal=True)
    part = PartitionConfig(name="by_file")
    seen = []
    for p in range(len(DOCS)):
        idx = partition_indices(src.groups, len(DOCS), p, part, 42)
        files = set(src.groups[idx].tolist())
        assert len(files) == 1 and (src.groups == files.pop()).sum() == len(idx)
        seen += idx.tolist()
    assert sorted(seen) == list(range(len(src.groups)))
    with pytest.raises(ConfigError, match="one partition per file: the data has 4 file"):
        partition_indices(src.groups, 3, 0, part, 42)


def test_language_model_metrics_are_exact_whatever_the_batch() -> None:
    torch.manual_seed(0)
    logits, targets = torch.randn(10, 7, 30), torch.randint(0, 30, (10, 7))
    targets[0, :3] = -100  # positions without a next token are ignored
    task = LanguageModelTask(["token_accuracy", "perplexity"])
    valid = targets != -100
    nll = F.cross_entropy(logits[valid], targets[valid])
    acc = float((logits.argmax(-1)[valid] == targets[valid]).float().mean())

    class Identity(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return logits[x[:, 0]]

    data = Examples(torch.arange(10)[:, None].repeat(1, 7), targets)
    for batch in (10, 3):
        _, metrics = evaluate(Identity(), data, resolve_precision("off", torch.device("cpu")), task, batch_size=batch)
        assert metrics["token_accuracy"] == pytest.approx(acc)
        assert metrics["perplexity"] == pytest.approx(math.exp(float(nll)), rel=1e-6)


def test_a_lora_federation_sends_only_adapters_learns_and_exports_loadable_models(corpus: Path, tmp_path: Path) -> None:
    sent_keys: set[str] = set()

    def tamper(node: int, reply: Message) -> Message:
        if reply.metadata.message_type == "train" and not reply.has_error():
            sent_keys.update(reply.content.array_records[ARRAYS].keys())
        return reply

    overrides = f"{LM} dataset.path={corpus} dataset.cache_dir={tmp_path / 'tok'} federation.rounds=3 train.lr=0.003"
    summary, grid = run_in_process(overrides, tmp_path / "runs", nodes=4, tamper=tamper)
    assert summary["status"] == "completed"
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"]  # it learns
    assert all(math.isclose(r["perplexity"], math.exp(r["loss"]), rel_tol=1e-5) for r in rows)
    assert sent_keys and all("lora_" in k for k in sent_keys)  # the base never travels

    cfg = _lm_config(corpus)
    spec = DataSpec((64,), 259, causal_lm=True)
    hf_dir = Path(summary["run_dir"]) / "hf"
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    final = torch.load(Path(summary["run_dir"]) / "model_final.pt", weights_only=True)
    ours = hf_model(cfg.model, spec)
    ours.load_state_dict(final)
    ours.eval()
    ids = torch.randint(0, 259, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ours(ids)
        base = hf_model(ModelConfig(**{**vars(cfg.model), "peft": "none"}), spec).inner
        adapted = PeftModel.from_pretrained(base, str(hf_dir / "adapter")).eval()
        merged = AutoModelForCausalLM.from_pretrained(str(hf_dir / "merged")).eval()
        torch.testing.assert_close(adapted(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, atol=1e-4, rtol=1e-4)


def test_a_node_with_another_base_refuses_to_train() -> None:
    spec = DataSpec((16,), 259, causal_lm=True)
    cfg = ModelConfig(
        name="hf",
        config={
            "model_type": "llama",
            "vocab_size": 259,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
        },
        peft="lora",
    )
    a, b = hf_model(cfg, spec), hf_model(cfg, spec)
    frozen = {k: v for k, v in a.state_dict().items() if "lora_" not in k}
    assert base_digest(frozen) == base_digest({k: v for k, v in b.state_dict().items() if "lora_" not in k})
    check_base(frozen, base_digest(frozen), cfg)  # the same base: accepted
    other = dict(frozen)
    key = next(k for k in other if k.endswith("embed_tokens.weight"))
    other[key] = other[key].clone()
    other[key][0, 0] += 1e-3
    with pytest.raises(ValueError, match=f"has digest {base_digest(other)}, the server's has {base_digest(frozen)}"):
        check_base(other, base_digest(frozen), cfg)
    assert BASE_DIGEST.startswith("model.")


def test_sequence_classification_federation_reports_accuracy(labelled: Path, tmp_path: Path) -> None:
    overrides = (
        f"model=hf_tiny task=sequence_classification dataset=text dataset.path={labelled} dataset.block_size=96 "
        f"dataset.cache_dir=null federation.rounds=2 train.epochs=1 train.optimizer=adamw train.lr=0.003"
    )
    summary, _ = run_in_process(overrides, tmp_path / "runs", nodes=2)
    assert summary["status"] == "completed" and 0.0 <= summary["final_metric"] <= 1.0
    assert summary["primary_metric"] == "accuracy"


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        ("model=hf_tiny task=causal_lm", "model=hf reads token ids: use dataset=text"),
        ("model=hf_tiny", "model=hf needs task.type=causal_lm or sequence_classification"),
        ("task=causal_lm", "task.type=causal_lm needs model=hf"),
        ("{lm} task.metrics=[perplexity,token_accuracy]", "perplexity is lower-is-better"),
        ("{lm} partition=dirichlet", "task.type=causal_lm has no labels to skew"),
        ("{lm} task.metrics=[accuracy]", "task.type=causal_lm reports token_accuracy, perplexity"),
        ("partition=by_file", "partition=by_file splits text files"),
    ],
)
def test_text_settings_that_do_not_fit_are_refused(corpus: Path, overrides: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem.replace("[", r"\[").replace(".", r"\.")):
        load_config(overrides.format(lm=f"{LM} dataset.path={corpus}"))


def test_task_from_config_picks_the_language_model_task() -> None:
    task = Task.from_config(
        TaskConfig(type="causal_lm", metrics=["token_accuracy"]), DataSpec((8,), 10, causal_lm=True)
    )
    assert isinstance(task, LanguageModelTask) and task.primary == "token_accuracy"


@pytest.mark.parametrize(
    "extra",
    [
        "strategy=median",
        "strategy=fedbuff federation.rounds=3",
        "privacy=central privacy.noise_multiplier=0.1 privacy.clip_norm=1.0",
        "privacy=local train.batch_size=16",
        "compression=int8",
        "model.peft=none",
    ],
)
def test_adapters_compose_with_the_rest_of_the_app(corpus: Path, tmp_path: Path, extra: str) -> None:
    overrides = f"{LM} dataset.path={corpus} dataset.cache_dir={tmp_path} federation.rounds=2 train.lr=0.003 {extra}"
    summary, _ = run_in_process(overrides, tmp_path / "runs", nodes=4)
    assert summary["status"] == "completed"
    assert (Path(summary["run_dir"]) / "hf" / "merged").is_dir()


def test_a_saved_dataset_and_a_nodes_own_files_read_like_text_files(labelled: Path, tmp_path: Path) -> None:
    import datasets

    rows = [json.loads(line) for line in (labelled / "texts.jsonl").read_text().splitlines()]
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(saved))
    cfg = DatasetConfig(name="text", block_size=48, cache_dir=None)
    from_files = text_source(replace(cfg, path=str(labelled)), ModelConfig(name="hf"), causal=False)
    from_saved = text_source(replace(cfg, path=str(saved)), ModelConfig(name="hf"), causal=False)
    np.testing.assert_array_equal(from_files.x, from_saved.x)
    np.testing.assert_array_equal(from_files.labels, from_saved.labels)
    from app.task.data import load_local_data  # a deployed node's data-path

    own = load_local_data(cfg, str(labelled / "texts.jsonl"), 42, ModelConfig(name="hf"), "sequence_classification")
    np.testing.assert_array_equal(own.x, from_files.x)


def test_exported_text_partitions_tokenize_back_to_the_same_rows(labelled: Path, tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from export_partitions import export_partitions

    overrides = (
        f"model=hf_tiny task=sequence_classification dataset=text dataset.path={labelled} dataset.block_size=48 "
        "dataset.cache_dir=null"
    )
    paths = export_partitions(tmp_path / "parts", 3, overrides)
    cfg = DatasetConfig(name="text", block_size=48, cache_dir=None)
    rows = [text_source(replace(cfg, path=str(p)), ModelConfig(name="hf"), causal=False) for p in paths]
    cfg_full, _ = load_config(overrides)
    from app.task.data import load_splits

    train_rows = load_splits(cfg_full.dataset, cfg_full.seed, cfg_full.model, "sequence_classification")[0]
    together = np.concatenate([r.x for r in rows])
    assert len(together) == len(train_rows.x)
    key = lambda a: sorted(map(tuple, a.tolist()))  # noqa: E731
    assert key(together) == key(train_rows.x)  # every training row, once, byte for byte


def test_a_lora_run_resumes_from_its_checkpoint(corpus: Path, tmp_path: Path) -> None:
    # a constant lr: the resume extends federation.rounds, over which the default cosine is laid
    lr = "train.lr=0.003 train.lr_schedule=constant"
    base = f"{LM} dataset.path={corpus} dataset.cache_dir={tmp_path / 'tok'} {lr} name=lora resume=auto"
    first, _ = run_in_process(f"{base} federation.rounds=2", tmp_path / "runs", nodes=4)
    resumed, _ = run_in_process(f"{base} federation.rounds=3", tmp_path / "runs", nodes=4)
    assert resumed["status"] == "completed" and resumed["rounds_completed"] == 3
    whole, _ = run_in_process(f"{LM} dataset.path={corpus} {lr} federation.rounds=3", tmp_path / "w", nodes=4)
    assert resumed["final_metric"] == pytest.approx(whole["final_metric"], abs=1e-9)  # the same run, in two parts


def test_a_vocabulary_smaller_than_the_datas_tokens_is_refused_before_round_1() -> None:
    from app.task.models import check_fits

    small = {"model_type": "llama", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2}  # fmt: skip
    cfg = ModelConfig(name="hf", config=small)
    spec = DataSpec((8,), 259, causal_lm=True)
    with pytest.raises(ConfigError, match="vocabulary of at least the 259 token ids"):
        check_fits(hf_model(cfg, spec), cfg, spec, torch.zeros(2, 8, dtype=torch.long))


def _bpe(merges: list[tuple[str, str]]):  # noqa: ANN202 - a transformers fast tokenizer
    """A byte-pair tokenizer over a fixed vocabulary whose merges decide how "abc" splits."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "a": 2, "b": 3, "c": 4, "ab": 5, "bc": 6, " ": 7}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="[UNK]"))
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", unk_token="[UNK]")


def test_the_token_cache_follows_labels_files_and_the_whole_tokenizer(tmp_path: Path) -> None:
    """Audit 3, finding 11: a cache entry is keyed on everything that makes its rows. Each case
    changes one thing the old key ignored and expects the rows a fresh tokenization gives."""
    cache = tmp_path / "cache"
    byte = load_tokenizer(ModelConfig(name="hf"))

    def rows(path: Path, tok, causal: bool, block: int = 8) -> dict[str, np.ndarray]:  # noqa: ANN001
        cfg = DatasetConfig(name="text", path=str(path), cache_dir=str(cache), block_size=block)
        cached = tokenize(read_texts(cfg, str(path)), tok, cfg, causal)
        fresh = tokenize(read_texts(cfg, str(path)), tok, replace(cfg, cache_dir=None), causal)
        for key in fresh:
            np.testing.assert_array_equal(cached[key], fresh[key], err_msg=key)
        return cached

    # labels: a site corrects them
    site = tmp_path / "site.jsonl"
    texts = ["great film", "awful film", "fine film", "bad film"]
    for labels in ([0, 0, 0, 0], [1, 0, 1, 0]):
        site.write_text("".join(json.dumps({"text": t, "label": lab}) + "\n" for t, lab in zip(texts, labels)))
        assert rows(site, byte, causal=False)["y"].tolist() == labels
    # files: the same texts in one file, then in two (causal blocks never cross a file)
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    (one / "all.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    for i, t in enumerate(texts):
        (two / f"{i}.jsonl").write_text(json.dumps({"text": t}) + "\n")
    assert len(set(rows(one, byte, causal=True)["groups"].tolist())) == 1
    assert len(set(rows(two, byte, causal=True)["groups"].tolist())) == 4
    # the tokenizer's merges: one vocabulary, two ways to split "abc"
    abc = tmp_path / "abc.jsonl"
    abc.write_text(json.dumps({"text": "abc abc abc", "label": 1}) + "\n" + json.dumps({"text": "cab", "label": 0}) + "\n")
    first = rows(abc, _bpe([("a", "b")]), causal=False)["x"]
    second = rows(abc, _bpe([("b", "c")]), causal=False)["x"]
    assert first[0, :2].tolist() == [5, 4] and second[0, :2].tolist() == [2, 6]


def test_a_cache_entry_that_cannot_be_the_rows_is_replaced(corpus: Path, tmp_path: Path, caplog) -> None:
    """Audit 3, finding 11: cached arrays are checked (names, dtype, shape, token ids within the
    vocabulary) before use; a bad entry is tokenized again and rewritten, with a warning."""
    cfg = DatasetConfig(name="text", path=str(corpus), block_size=32, cache_dir=str(tmp_path))
    tok = load_tokenizer(ModelConfig(name="hf"))
    texts = read_texts(cfg, str(corpus))
    good = tokenize(texts, tok, cfg, causal=True)
    (entry,) = tmp_path.glob("*.npz")
    bad = [
        {**good, "x": good["x"] + len(tok)},  # ids beyond the vocabulary
        {**good, "x": good["x"].astype(np.int32)},
        {**good, "y": good["y"][:, :-1]},
        {"x": good["x"], "y": good["y"]},
    ]
    for arrays in bad:
        with entry.open("wb") as f:
            np.savez(f, **arrays)
        caplog.clear()
        again = tokenize(texts, tok, cfg, causal=True)
        for key in good:
            np.testing.assert_array_equal(again[key], good[key])
        assert "tokenizing again" in caplog.text
    entry.write_bytes(b"not an npz")
    np.testing.assert_array_equal(tokenize(texts, tok, cfg, causal=True)["x"], good["x"])
    with np.load(entry) as f:  # rewritten
        np.testing.assert_array_equal(f["x"], good["x"])
