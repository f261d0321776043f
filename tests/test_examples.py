"""The three examples of docs/examples.md, each run in process through its preset
(conf/example/) with few rounds: they would fail if an example's code, preset or the app
path it shows broke."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.config.compose import load_config
from app.config.schema import ConfigError
from app.run.results import read_rows
from app.task.models import matches
from app.tools.in_process import run_in_process
from examples.finetune.run import HEAD, pretrain
from examples.finetune.task import half
from examples.tabular.task import load


def test_presets_compose_into_the_examples_settings(tmp_path, monkeypatch):
    tabular = load_config("+example=breast_cancer")[0]
    assert (tabular.model.target, tabular.dataset.target) == ("examples.tabular.task.MLP", "examples.tabular.task.load")
    assert tabular.task.metrics[0] == "auroc" and tabular.partition.name == "dirichlet"
    vision = load_config("+example=torchvision model.arch=mobilenet_v3_small")[0]
    assert (vision.model.name, vision.model.arch) == ("torchvision", "mobilenet_v3_small")
    (tmp_path / "w.pt").touch()  # validation checks that the file exists; the server loads it
    tuned = load_config(f"+example=finetune model.init_weights={tmp_path / 'w.pt'}")[0]
    assert tuned.model.trainable == [HEAD] and tuned.dataset.kwargs == {"which": "b"}
    monkeypatch.setenv("HOME", str(tmp_path))  # the preset's default: the file the example's command writes
    with pytest.raises(ConfigError, match=r"model.init_weights=.*/fedgpu-runs/examples/finetune/pretrained.pt"):
        load_config("+example=finetune")


def test_tabular_loader_standardises_with_training_statistics_only():
    from sklearn.datasets import load_breast_cancer

    (x, y), (x_test, y_test) = load()
    assert x.shape == (455, 30) and x_test.shape == (114, 30) and set(np.unique(y)) == {0, 1}
    np.testing.assert_allclose(x.mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(x.std(0), 1, atol=1e-4)
    # one affine map per feature takes the raw values of train and test rows alike (sorted, they
    # fit a line exactly): the test rows were standardised with the training mean and std too
    raw, both = load_breast_cancer().data, np.concatenate([x, x_test]).astype(np.float64)
    for j in range(raw.shape[1]):
        mapped, target = np.sort(both[:, j]), np.sort(raw[:, j])
        slope, intercept = np.polyfit(mapped, target, 1)
        np.testing.assert_allclose(mapped * slope + intercept, target, atol=1e-4 * target.std())
    assert not np.allclose(x_test.mean(0), 0, atol=1e-3)  # not standardised with its own mean


def test_breast_cancer_example_ranks_tumours_well(tmp_path):
    summary = run_in_process("+example=breast_cancer federation.rounds=3", tmp_path, nodes=5)[0]
    assert summary["status"] == "completed" and summary["primary_metric"] == "auroc"
    assert summary["final_metric"] > 0.95  # chance is 0.5; 10 rounds reach ~0.99
    assert summary["final_accuracy"] > 0.85


def test_finetune_example_sends_only_the_head_and_keeps_the_body(tmp_path):
    weights = tmp_path / "pretrained.pt"
    pretrain(weights)  # 5 epochs: 0.92 on the federation's test split before fine-tuning
    overrides = f"+example=finetune model.init_weights={weights} federation.rounds=2 train.epochs=1 name=head"
    summary = run_in_process(overrides, tmp_path, nodes=3)[0]
    assert summary["status"] == "completed" and summary["final_accuracy"] > 0.85  # chance 0.1
    rows = read_rows(tmp_path / "head")
    # bytes_down is the whole model sent to a node; a reply carries the head only (~1/70 of it)
    assert all(0 < r["bytes_up"] < r["bytes_down"] / 50 for r in rows)
    before = torch.load(weights, weights_only=True)
    after = torch.load(tmp_path / "head" / "model_final.pt", weights_only=True)
    body = [k for k in before if not matches(k, [HEAD])]
    assert body and all(torch.equal(after[k], before[k]) for k in body)
    assert not torch.equal(after[f"{HEAD}.weight"], before[f"{HEAD}.weight"])


def test_finetune_halves_split_the_digits_in_two():
    from sklearn.datasets import load_digits

    (xa, ya), (xb, yb) = half("a"), half("b")
    assert xa.shape == (898, 1, 8, 8) and xb.shape == (899, 1, 8, 8) and xa.dtype == np.uint8
    assert set(ya) == set(yb) == set(range(10))
    digits = load_digits()
    whole = np.round(digits.images * (255 / 16)).astype(np.uint8)[:, None]

    def rows(x: np.ndarray, y: np.ndarray) -> list[bytes]:
        return sorted(image.tobytes() + bytes([label]) for image, label in zip(x, y, strict=True))

    assert rows(np.concatenate([xa, xb]), np.concatenate([ya, yb])) == rows(whole, digits.target)


def test_torchvision_example_learns_the_digits(tmp_path):
    # In process the nodes train one after another; one intra-op thread keeps two threads from
    # thrashing on a shared 2-core machine (this test ran > 10 min without it).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        overrides = "+example=torchvision federation.rounds=2 train.epochs=1"
        summary = run_in_process(overrides, tmp_path, nodes=2)[0]
    finally:
        torch.set_num_threads(threads)
    assert summary["status"] == "completed"
    assert summary["final_accuracy"] > 0.3  # ten classes: chance is 0.1


def test_lora_example_preset_runs_on_the_corpus_the_docs_write(tmp_path, monkeypatch):
    import subprocess
    import sys

    monkeypatch.setenv("HOME", str(tmp_path))  # the preset's corpus: ~/fedgpu-runs/examples/corpus
    corpus = tmp_path / "fedgpu-runs" / "examples" / "corpus"
    subprocess.run([sys.executable, "scripts/text_corpus.py", "--out", str(corpus)], check=True, capture_output=True)
    cfg = load_config("+example=lora")[0]
    assert (cfg.model.name, cfg.task.type, cfg.dataset.path) == ("hf", "causal_lm", str(corpus))
    summary = run_in_process("+example=lora federation.rounds=2 dataset.cache_dir=null", tmp_path / "runs", nodes=3)[0]
    assert summary["status"] == "completed" and summary["primary_metric"] == "token_accuracy"
