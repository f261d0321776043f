"""Bring your own task: models, loaders, pretrained weights and trainable subsets given by
config, and every refusal naming the key and the reason (the user's code: tests/own_task.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Message

from app.config.compose import load_config
from app.config.schema import ConfigError, DatasetConfig, ModelConfig, PartitionConfig
from app.run.results import read_rows
from app.task.data import (
    DatasetUnavailableError,
    DataSpec,
    data_spec,
    load_local_data,
    load_splits,
    materialize,
    partition_indices,
)
from app.task.models import build_model, check_fits, load_init_weights, trainable_keys
from app.task.user_code import call, locate
from app.tools.in_process import run_in_process
from strategies.keys import ARRAYS, FROZEN
from strategies.replies import payload_bytes

OWN = "tests.own_task"
TABULAR = DataSpec((6,), 2)


# --- finding and calling the user's code ---------------------------------------------------


def test_locate_names_the_key_and_what_is_wrong(tmp_path, monkeypatch):
    cases = {
        "nosuchpkg_xyz.f": "no module 'nosuchpkg_xyz' can be imported",
        f"{OWN}.nothing_here": "has no attribute 'nothing_here'",
        f"{OWN}.NOT_CALLABLE": "is a int, not a callable",
        "justaname": "give a dotted path",
    }
    for path, words in cases.items():
        with pytest.raises(ConfigError) as err:
            locate(path, "model._target_")
        assert str(err.value).startswith(f"model._target_={path!r}") and words in str(err.value), str(err.value)
    # a module that exists but imports something missing: the missing import is named
    (tmp_path / "bad_import_mod.py").write_text("import module_that_does_not_exist_xyz\n\ndef f():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="importing bad_import_mod failed.*module_that_does_not_exist_xyz"):
        locate("bad_import_mod.f", "dataset._target_")


def test_call_offers_what_the_signature_asks_for_and_wraps_failures():
    model = call("model._target_", f"{OWN}.MLP", {"hidden": 7}, {"input_shape": (6,), "num_classes": 2, "spec": None})
    assert model.body[1].in_features == 6 and model.body[1].out_features == 7 and model.head.out_features == 2
    with pytest.raises(ConfigError, match=r"model\._target_='tests\.own_task\.broken' failed .*ValueError"):
        call("model._target_", f"{OWN}.broken", {"x": 1}, {"spec": TABULAR})


# --- models ---------------------------------------------------------------------------------


def test_custom_model_gets_the_spec_and_must_return_a_module():
    model = build_model(ModelConfig(name="custom", target=f"{OWN}.mlp_from_spec", kwargs={"hidden": 5}), TABULAR)
    assert model.head.in_features == 5 and model.head.out_features == 2
    with pytest.raises(ConfigError, match="returned a int, not a torch.nn.Module"):
        build_model(ModelConfig(name="custom", target=f"{OWN}.not_a_module"), TABULAR)


def test_a_model_that_does_not_fit_the_data_is_refused_before_training():
    wrong = ModelConfig(name="custom", target=f"{OWN}.wrong_outputs")
    with pytest.raises(
        ConfigError, match=r"model\._target_=tests\.own_task\.wrong_outputs maps 2 examples to \(2, 3\)"
    ):
        check_fits(build_model(wrong, TABULAR), wrong, TABULAR, torch.zeros(2, 6))
    mlp = ModelConfig(name="custom", target=f"{OWN}.MLP")
    with pytest.raises(ConfigError, match=r"cannot take this data's examples \(shaped \(6,\)"):
        check_fits(build_model(mlp, DataSpec((5,), 2)), mlp, TABULAR, torch.zeros(2, 6))
    with pytest.raises(ConfigError, match=r"model.name=cnn takes images .* shaped \(6,\); use model=custom"):
        build_model(ModelConfig(), TABULAR)


def test_torchvision_model_by_name_is_adapted_to_the_data():
    cfg = ModelConfig(name="torchvision", arch="mobilenet_v3_small")
    spec = DataSpec((1, 8, 8), 10)
    model = build_model(cfg, spec)
    check_fits(model, cfg, spec, torch.rand(2, 1, 8, 8))  # one input channel, ten classes
    assert model.features[0][0].in_channels == 1
    with pytest.raises(ConfigError, match="model.arch='no_such_net' is not a torchvision classification model"):
        build_model(ModelConfig(name="torchvision", arch="no_such_net"), spec)


def test_init_weights_load_weights_only_and_mismatches_are_named(tmp_path):
    spec = DataSpec((1, 8, 8), 10)
    source = build_model(ModelConfig(width=8), spec)
    torch.save(source.state_dict(), tmp_path / "w.pt")
    target = build_model(ModelConfig(width=8), spec)
    load_init_weights(target, str(tmp_path / "w.pt"))
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value)
    wider = build_model(ModelConfig(width=16), spec)
    with pytest.raises(ConfigError) as err:
        load_init_weights(wider, str(tmp_path / "w.pt"))
    assert "model.init_weights=" in str(err.value) and "net.0.weight: file (8, 1, 3, 3), model (16, 1, 3, 3)" in str(
        err.value
    )
    partial = {k: v for k, v in source.state_dict().items() if not k.startswith("net.12")}
    torch.save({**partial, "extra.bias": torch.zeros(1)}, tmp_path / "p.pt")
    with pytest.raises(ConfigError, match=r"missing net\.12\.bias; missing net\.12\.weight; unexpected extra\.bias"):
        load_init_weights(target, str(tmp_path / "p.pt"))
    torch.save({"model": source}, tmp_path / "pickled.pt")  # a whole pickled module: could run code
    with pytest.raises(ConfigError, match="not a weights-only file"):
        load_init_weights(target, str(tmp_path / "pickled.pt"))


def test_trainable_prefixes_end_at_a_dot_and_must_cover_a_parameter():
    model = build_model(ModelConfig(name="custom", target=f"{OWN}.MLP"), TABULAR)
    assert trainable_keys(model, ["head"]) == ["head.weight", "head.bias"]
    assert trainable_keys(model, []) == list(model.state_dict())
    with pytest.raises(ConfigError, match=r"\['hea'\] cover no parameter; the model's modules are \['body', 'head'\]"):
        trainable_keys(model, ["hea"])


# --- data -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "shape", "classes", "train_n"),
    [
        ("tabular", (6,), 2, 400),  # ((x, y), (x_test, y_test))
        ("tabular_dict", (4,), 2, 200),  # {"train": ..., "test": ...}
        ("tabular_train_only", (6,), 2, 160),  # (x, y): test_fraction held out
        ("sequences", (5, 3), 3, 96),  # torch tensors, N x T x F
        ("hf_tabular", (4,), 2, 96),  # a Hugging Face Dataset with a list column
    ],
)
def test_python_loaders_of_any_shape(target, shape, classes, train_n):
    key = "features" if target.startswith("hf") else "image"  # the input column of a Hugging Face dataset
    train, test = load_splits(DatasetConfig(name="python", target=f"{OWN}.{target}", image_key=key), 0)
    assert len(train.labels) == train_n
    assert data_spec(train, test) == DataSpec(shape, classes)
    data = materialize(train, np.arange(3))
    assert tuple(data.x.shape) == (3, *shape) and data.x.dtype == torch.float32 and data.y.dtype == torch.int64


def test_multilabel_targets_and_the_partitioners():
    train, test = load_splits(DatasetConfig(name="python", target=f"{OWN}.multilabel"), 0)
    assert data_spec(train, test) == DataSpec((5,), 3, multilabel=True)
    assert materialize(train, np.arange(2)).y.dtype == torch.float32
    iid = partition_indices(train.labels, 4, 1, PartitionConfig(), 0)
    assert len(iid) == len(train.labels) // 4
    with pytest.raises(ConfigError, match="partition.name=dirichlet splits by class label"):
        partition_indices(train.labels, 4, 1, PartitionConfig(name="dirichlet"), 0)


def test_bad_loader_results_are_refused_with_the_key():
    with pytest.raises(DatasetUnavailableError, match=r"dataset._target_=tests.own_task.mismatched: 20 inputs but 21"):
        load_splits(DatasetConfig(name="python", target=f"{OWN}.mismatched"), 0)
    with pytest.raises(DatasetUnavailableError, match="returned a int; expected"):
        load_splits(DatasetConfig(name="python", target=f"{OWN}.not_a_module"), 0)


def test_a_deployed_node_reads_its_own_file_through_the_loader(tmp_path):
    x, y = np.ones((7, 6), np.float32), np.arange(7) % 2
    np.savez(tmp_path / "node.npz", x=x, y=y)
    source = load_local_data(DatasetConfig(name="python", target=f"{OWN}.node_file"), str(tmp_path / "node.npz"), 0)
    assert source.x.shape == (7, 6) and list(source.labels) == list(y)
    # a loader without a data_path parameter: the node's .npz is read as it is (no image reshaping)
    plain = load_local_data(DatasetConfig(name="python", target=f"{OWN}.tabular"), str(tmp_path / "node.npz"), 0)
    assert plain.x.shape == (7, 6)


# --- whole federations ------------------------------------------------------------------------

CUSTOM = f"model=custom model._target_={OWN}.MLP model.hidden=16 dataset=python dataset._target_={OWN}.tabular"


def test_custom_model_and_loader_federate_end_to_end(tmp_path):
    summary = run_in_process(CUSTOM + " federation.rounds=3 train.epochs=2 train.lr=0.05", tmp_path, nodes=3)[0]
    assert summary["status"] == "completed"
    assert summary["final_accuracy"] > 0.85  # two separable classes; chance is 0.5
    cfg, _ = load_config(CUSTOM)
    assert cfg.model.kwargs == {"hidden": 16}


def test_frozen_parameters_never_leave_the_node_and_stay_bit_identical(tmp_path):
    """model.trainable=[head]: replies carry head.* only, the server's body is the initial
    one bit for bit, and bytes_up / bytes_down are the arrays' bytes in the messages."""
    seen: list[tuple[list[str], int]] = []
    sent: list[tuple[list[str], list[str]]] = []

    def watch(node: int, reply: Message) -> Message:
        seen.append((list(reply.content[ARRAYS].keys()), payload_bytes(reply.content)))
        return reply

    from app.client_app import app as client_app
    from app.simulation.local_grid import InProcessGrid

    class Grid(InProcessGrid):
        def push_messages(self, messages):  # noqa: ANN001, ANN202
            messages = list(messages)
            for m in messages:
                frozen = list(m.content[FROZEN].keys()) if FROZEN in m.content else []
                sent.append((list(m.content[ARRAYS].keys()), frozen))
            return super().push_messages(messages)

    overrides = CUSTOM + " model.trainable=[head] federation.rounds=2 train.epochs=1 name=ft"
    grid = Grid(client_app, 3, tamper=watch)
    summary = run_in_process(overrides, tmp_path, grid=grid)[0]
    assert summary["status"] == "completed" and len(seen) == 6
    assert all(keys == ["head.weight", "head.bias"] for keys, _ in seen)
    assert all(arrays == ["head.weight", "head.bias"] and frozen[0].startswith("body.") for arrays, frozen in sent)
    final = torch.load(tmp_path / "ft" / "model_final.pt", weights_only=True)
    torch.manual_seed(load_config(overrides)[0].seed)  # the server builds its model right after seeding
    initial = build_model(ModelConfig(name="custom", target=f"{OWN}.MLP", kwargs={"hidden": 16}), TABULAR).state_dict()
    for key in ("body.1.weight", "body.1.bias"):
        assert torch.equal(final[key], initial[key])
    assert not torch.equal(final["head.weight"], initial["head.weight"])
    rows = read_rows(tmp_path / "ft")
    head_bytes = payload_bytes_of({k: final[k] for k in ("head.weight", "head.bias")})
    assert all(r["bytes_up"] == head_bytes for r in rows)
    assert all(r["bytes_down"] == payload_bytes_of(final) for r in rows)


def payload_bytes_of(state: dict[str, torch.Tensor]) -> int:
    return sum(len(a.data) for a in ArrayRecord({k: v.clone() for k, v in state.items()}).values())


def test_init_weights_start_the_federation_and_resume_keeps_the_frozen_part(tmp_path):
    torch.manual_seed(123)
    pretrained = build_model(ModelConfig(name="custom", target=f"{OWN}.MLP", kwargs={"hidden": 16}), TABULAR)
    torch.save(pretrained.state_dict(), tmp_path / "pre.pt")
    base = CUSTOM + f" model.init_weights={tmp_path / 'pre.pt'} model.trainable=[head] train.epochs=1 name=run"
    run_in_process(base + " federation.rounds=1", tmp_path / "out", nodes=2)
    summary = run_in_process(
        base + f" federation.rounds=2 resume={tmp_path / 'out' / 'run' / 'checkpoint.pt'}", tmp_path / "out", nodes=2
    )[0]
    assert summary["rounds_completed"] == 2
    final = torch.load(tmp_path / "out" / "run" / "model_final.pt", weights_only=True)
    assert torch.equal(final["body.1.weight"], pretrained.state_dict()["body.1.weight"])
    with pytest.raises(ConfigError, match=r"model.init_weights=.* does not fit the model: .*body.1.weight"):
        run_in_process(CUSTOM + f" model.hidden=8 model.init_weights={tmp_path / 'pre.pt'}", tmp_path / "bad", nodes=2)


# --- a custom task with the rest of the app (docs/testing.md#your-own-task) --------------------

# Three rounds of one epoch: a bolder step than the default recipe's lr 0.02, so they learn.
MATRIX = CUSTOM + " task.metrics=[auroc,accuracy] train.epochs=1 train.lr=0.05"


@pytest.mark.parametrize(
    ("extra", "nodes", "learns"),
    [
        ("strategy=krum strategy.num_byzantine=1", 5, True),
        ("strategy=trimmed_mean strategy.trim_ratio=0.2", 5, True),
        ("strategy=fedbuff strategy.buffer_size=2 federation.rounds=4", 3, True),
        ("privacy=central privacy.noise_multiplier=0.3 privacy.clip_norm=5", 3, False),
        ("privacy=local privacy.noise_multiplier=0.5 model.trainable=[head]", 3, False),
        ("train.amp=bf16 model.trainable=[head] strategy=median", 3, True),
        ("attack=sign_flip attack.num_malicious=1 strategy=krum strategy.num_byzantine=1", 5, True),
    ],
)
def test_a_custom_task_composes_with_the_rest(tmp_path, extra, nodes, learns):
    summary = run_in_process(f"{MATRIX} federation.rounds=3 {extra} name=m", tmp_path, nodes=nodes)[0]
    assert summary["status"] == "completed" and summary["primary_metric"] == "auroc"
    rows = read_rows(tmp_path / "m")
    assert all(r["auroc"] is None or 0.0 <= r["auroc"] <= 1.0 for r in rows) and rows[-1]["bytes_up"] > 0
    if learns:
        assert summary["final_metric"] > 0.9, summary  # two separable classes: AUROC 0.5 is chance


def test_local_dp_names_the_layer_opacus_cannot_train(monkeypatch):
    from opacus.validators import ModuleValidator
    from opacus.validators.errors import UnsupportedModuleError

    from app.privacy.dp_sgd import make_private_compatible
    from tests.own_task import OddLinear

    unsupported = [UnsupportedModuleError("no per-sample gradients")]
    monkeypatch.setitem(ModuleValidator.VALIDATORS, OddLinear, lambda m: unsupported)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Sequential(OddLinear(3, 2)))
    with pytest.raises(ConfigError, match=r"Opacus cannot train layer 1.0 \(OddLinear\): no per-sample"):
        make_private_compatible(model)
    model[1][0].requires_grad_(False)  # a frozen layer computes no gradients: fine
    make_private_compatible(model)


@pytest.mark.parametrize(
    "overrides",
    ["", f"dataset=python dataset._target_={OWN}.sequences", f"dataset=python dataset._target_={OWN}.multilabel"],
)
def test_exported_partitions_hold_what_the_simulated_node_trains_on(tmp_path, overrides):
    """scripts/export_partitions.py: a deployed node reading its file gets the very values a
    simulated node of that partition gets (digits stay uint8 0-255, not floats 0-255)."""
    from tests.helpers import load_script

    cfg, _ = load_config(overrides)
    path = load_script("export_partitions").export_partitions(tmp_path, 3, overrides)[1]
    train, _ = load_splits(cfg.dataset, cfg.seed)
    expected = materialize(train, partition_indices(train.labels, 3, 1, cfg.partition, cfg.seed))
    got = materialize(load_local_data(cfg.dataset, str(path), cfg.seed))
    assert got.x.dtype == expected.x.dtype and torch.equal(got.x, expected.x) and torch.equal(got.y, expected.y)


def test_custom_loss_metric_and_federated_evaluation_end_to_end(tmp_path):
    """A loss `_target_` with an argument and a metric `_target_` (tests/test_metrics.py) in a
    whole run: the metric is a column, federated evaluation replies carry eval-<name>, and the
    run stops at its target on the primary metric."""
    overrides = (
        f"{CUSTOM} task.loss._target_=torch.nn.CrossEntropyLoss task.loss.label_smoothing=0.1 "
        "task.metrics=[{_target_:tests.test_metrics.top2_hits,name:top2},accuracy] federation.fraction_evaluate=1 "
        "federation.rounds=5 federation.target_value=0.99 train.epochs=1 name=c"
    )
    summary = run_in_process(overrides, tmp_path, nodes=2)[0]
    rows = read_rows(tmp_path / "c")
    assert summary["primary_metric"] == "top2" and rows[-1]["top2"] == 1.0  # two classes: top-2 always hits
    assert summary["stop_reason"] == "target top2 0.99 reached" and len(rows) == 1
    assert {"eval-top2", "eval-accuracy", "eval-loss"} <= rows[0]["federated_eval"].keys()
