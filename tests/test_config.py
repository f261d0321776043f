"""Bad config values are rejected before any work, with the key, value and what is allowed."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from flwr.app import Context, RecordDict

from app.config.compose import load_config
from app.config.schema import BUILTIN_METRICS, STRATEGIES, Config, ConfigError, PartitionConfig
from app.config.validate import validate
from app.protocol import ClientSettings, to_client_record
from app.run.results import new_run_dir, output_root
from app.task.data import check_partitioning


def test_defaults_compose_and_validate():
    cfg, raw = load_config("")
    assert (cfg.strategy.name, cfg.dataset.name, cfg.partition.name, cfg.model.name) == (
        "fedavg",
        "digits",
        "iid",
        "cnn",
    )
    assert raw.train.amp == "auto"


def test_overrides_string_is_applied():
    cfg, _ = load_config("partition=dirichlet partition.alpha=0.3 train.amp=bf16 federation.rounds=4 seed=7")
    assert cfg.partition.name == "dirichlet" and cfg.partition.alpha == 0.3
    assert cfg.train.amp == "bf16" and cfg.federation.rounds == 4 and cfg.seed == 7


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ("strategy=fedprox", ["strategy='fedprox'", "allowed: ", "fedavg, fedbuff"]),
        ("model=vit", ["model='vit'", "cnn, custom, hf, hf_tiny, resnet18, torchvision"]),
        ("dataset=imagenet", ["dataset='imagenet'", "digits"]),
        ("train.lr=0", ["train.lr=0", "> 0"]),
        ("train.lr=-0.1", ["train.lr=-0.1", "> 0"]),
        ("train.lr=abc", ["train.lr", "abc"]),
        ("federation.rounds=0", ["federation.rounds=0", ">= 1"]),
        ("partition=dirichlet partition.alpha=0", ["partition.alpha=0", "> 0"]),
        ("partition=dirichlet partition.alpha=-1", ["partition.alpha=-1", "> 0"]),
        ("train.batch_size=0", ["train.batch_size=0", ">= 1"]),
        ("train.epochs=0", ["train.epochs=0", ">= 1"]),
        ("train.amp=fp8", ["train.amp='fp8'", "fp16, bf16, off"]),
        ("train.optimizer=lbfgs", ["train.optimizer='lbfgs'", "sgd"]),
        ("train.device=tpu", ["train.device='tpu'", "cuda:N"]),
        ("train.grad_clip=-1", ["train.grad_clip=-1", ">= 0"]),
        ("train.channels_last=maybe", ["train.channels_last='maybe'", "auto, on, off"]),
        ("train.deterministic=true train.cudnn_benchmark=true", ["train.cudnn_benchmark=True", "deterministic"]),
        ("federation.fraction_train=0", ["federation.fraction_train=0", "(0, 1]"]),
        ("federation.fraction_train=1.5", ["federation.fraction_train=1.5", "(0, 1]"]),
        (
            "federation.min_train_nodes=5 federation.min_available_nodes=2",
            ["federation.min_available_nodes=2", ">= federation.min_train_nodes"],
        ),
        ("federation.message_ttl_s=10 federation.round_timeout_s=60", ["federation.message_ttl_s=10", "expire"]),
        ("dataset=npz", ["dataset.path=None", "dataset=npz needs dataset.path"]),
        ("dataset=npz dataset.path=/no/such/file.npz", ["dataset.path='/no/such/file.npz'", "no such .npz file"]),
        ("dataset=hf_disk dataset.path=/no/such/dir", ["dataset.path='/no/such/dir'", "no such directory"]),
        ("dataset.test_fraction=1.0", ["dataset.test_fraction=1.0", "(0, 1)"]),
        ("model=resnet18 model.width=32", ["model.width=32", "64 wide"]),
        ("resume=/no/checkpoint.pt", ["resume='/no/checkpoint.pt'", "no such checkpoint"]),
        ("resume=auto", ["resume='auto'", "needs a run name"]),
        ("seed=-1", ["seed=-1", ">= 0"]),
        ("train.lrr=0.1", ["train.lrr is not a config key"]),
        (
            "strategy=fedbuff strategy.eval_every=2",
            ["strategy.eval_every is now federation.eval_every", "federation.eval_every=2"],
        ),
        ("federation.eval_every=0", ["federation.eval_every=0", ">= 1"]),
        ("federation.rounds=[1,2", ["bad override"]),
        ("server_device=gpu", ["server_device='gpu'"]),
        ("strategy=trimmed_mean strategy.trim_ratio=0.5", ["strategy.trim_ratio=0.5", "trims everything"]),
        ("strategy=multikrum strategy.num_selected=0", ["strategy.num_selected=0", ">= 1"]),
        ("strategy=krum strategy.num_selected=3", ["strategy.num_selected=3", "use strategy=multikrum"]),
        ("strategy=krum strategy.num_byzantine=-1", ["strategy.num_byzantine=-1", ">= 0"]),
        ("strategy=krum strategy.on_too_few=average", ["strategy.on_too_few='average'", "skip, fallback"]),
        ("attack=poison", ["attack='poison'", "sign_flip"]),
        ("attack=sign_flip attack.scale=0", ["attack.scale=0", "> 0"]),
        ("attack=scale attack.num_malicious=-2", ["attack.num_malicious=-2", ">= 0"]),
    ],
)
def test_bad_value_is_rejected_with_its_key(overrides, words):
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    for word in words:
        assert word in str(err.value), f"{str(err.value)!r} lacks {word!r}"


def test_every_typo_is_named_at_once_with_the_closest_key_and_nothing_from_hydra():
    with pytest.raises(ConfigError) as err:
        load_config("strategy=krumm federation.round=3 train.lrr=0.1 stratgy.x=1 seed=2")
    text = str(err.value)
    assert text.splitlines() == [
        "4 problems:",
        "  - strategy='krumm' is not a known strategy option; did you mean krum? "
        f"(allowed: {', '.join(sorted(STRATEGIES))})",  # conf/strategy/*.yaml, one per registered name
        "  - federation.round is not a config key of federation; did you mean federation.rounds?",
        "  - train.lrr is not a config key of train; did you mean train.lr?",
        "  - stratgy.x: 'stratgy' is not a config section; did you mean strategy?",
    ], text
    assert err.value.__cause__ is None and err.value.__context__ is None, "Hydra's traceback rides along"
    # A key of the chosen option, and a name nothing is close to.
    with pytest.raises(
        ConfigError,
        match=r"strategy.num_byzantin is not a config key of strategy=krum; did you mean strategy.num_byzantine\?",
    ):
        load_config("strategy=krum strategy.num_byzantin=1")
    with pytest.raises(
        ConfigError,
        match=r"^federation.zzz is not a config key of federation \(the keys of each federation option are in conf/federation/\)$",
    ):
        load_config("federation.zzz=1")


def test_what_only_hydra_can_judge_is_one_line_without_its_traceback():
    with pytest.raises(ConfigError, match=r"^bad override in .*no viable alternative") as err:
        load_config("federation.rounds=[1,2")
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_every_value_of_the_wrong_type_is_named_at_once():
    with pytest.raises(ConfigError) as err:
        load_config("train.lr=abc federation.rounds=x seed=3")
    lines = str(err.value).splitlines()
    assert lines[0] == "2 problems:" and len(lines) == 3, lines
    assert lines[1].startswith("  - train.lr: Value 'abc'") and lines[2].startswith("  - federation.rounds: Value 'x'")


def test_every_invalid_value_is_named_at_once_like_the_typos():
    """Issue 34: one try names every bad key, in the block the typos above use, so a user
    fixes them all at once instead of one per run."""
    with pytest.raises(ConfigError) as err:
        load_config("strategy=trimmed_mean strategy.trim_ratio=0.7 compression.ratio=2 train.epochs=0")
    assert str(err.value).splitlines() == [
        "3 problems:",
        "  - strategy.trim_ratio=0.7 is invalid: must be in [0, 0.5): 0.5 or more trims everything",
        "  - compression.ratio=2.0 is invalid: must be in (0, 1]: the fraction of entries sent",
        "  - train.epochs=0 is invalid: must be >= 1",
    ], str(err.value)
    # One line per key: a key's later checks (Krum's m = 1 after m >= 1) do not repeat it.
    with pytest.raises(ConfigError, match=r"^strategy\.num_selected=0 is invalid: must be >= 1$"):
        validate(replace(Config(), strategy=replace(Config().strategy, name="krum", num_selected=0)))


def test_a_check_that_needs_a_bad_key_is_skipped_not_crashed():
    """Checks that use another key's value (the npz path, the aggregator central DP allows, the
    names of task.metrics, the run name resume=auto resumes) wait for that key to be valid:
    each bad key is named once, and nothing raises a TypeError or IndexError."""
    cfg = Config()
    cfg.strategy.name = "fedprox"  # central DP's aggregator check would name 'fedprox' again
    cfg.privacy.name, cfg.privacy.noise_multiplier = "central", 1.0
    cfg.dataset.name, cfg.dataset.path = "npz", None  # Path(None).is_file() is a TypeError
    cfg.task.metrics = [{"_target_": "nodots"}, 5]  # 5 is no name; 'nodots' makes none; no names[0]
    cfg.federation.target_accuracy = 0.9  # needs accuracy among the metrics: unknown yet
    cfg.federation.min_train_nodes, cfg.federation.min_available_nodes = 0, -1
    cfg.name, cfg.resume = "../x", "auto"  # resume=auto needs a run name: there is one, a bad one
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert str(err.value).splitlines() == [
        "6 problems:",
        f"  - strategy.name='fedprox' is invalid: allowed: {', '.join(STRATEGIES)}",
        "  - dataset.path=None is invalid: dataset=npz needs dataset.path=/abs/path/data.npz",
        "  - federation.min_train_nodes=0 is invalid: must be >= 1",
        "  - task.metrics[0]._target_='nodots' is invalid: give the dotted path of a callable, e.g. "
        "my_pkg.module.function",
        f"  - task.metrics[1]=5 is invalid: allowed: {', '.join(BUILTIN_METRICS)}, or "
        "{_target_: my_pkg.module.metric, name: ...}",
        "  - name='../x' is invalid: must be a single directory name under its root: not empty, no '/', '\\' or "
        "control characters, not starting with '.'",
    ], str(err.value)
    cfg = Config()
    cfg.task.metrics = []
    with pytest.raises(ConfigError, match=r"^task\.metrics=\[\] is invalid: name at least one metric"):
        validate(cfg)


def test_more_partitions_than_samples_is_rejected():
    with pytest.raises(ConfigError, match=r"num-partitions=2000 .* more partitions than the 1437"):
        check_partitioning(np.zeros(1437), 2000, PartitionConfig())
    with pytest.raises(ConfigError, match="partition.min_partition_size=10"):
        check_partitioning(np.zeros(100), 20, PartitionConfig(name="dirichlet", min_partition_size=10))
    check_partitioning(np.zeros(1437), 100, PartitionConfig())


def test_output_dir_must_be_absolute(tmp_path):
    assert output_root(str(tmp_path)) == tmp_path
    assert output_root("").is_absolute()
    with pytest.raises(ConfigError, match="output-dir='runs' must be an absolute path"):
        output_root("runs")


def test_npz_path_that_exists_is_accepted(tmp_path):
    path = tmp_path / "d.npz"
    np.savez(path, x=np.zeros((4, 8, 8), np.uint8), y=np.arange(4))
    cfg, _ = load_config(f"dataset=npz dataset.path={path}")
    assert cfg.dataset.path == str(path)


def test_client_settings_roundtrip_through_a_config_record():
    from flwr.app import ConfigRecord

    cfg, _ = load_config("train.lr=0.2 train.amp=bf16 partition=dirichlet seed=3")
    record = ConfigRecord(to_client_record(cfg))  # only ConfigRecord-legal scalars
    settings = ClientSettings.from_record(dict(record))
    assert settings == ClientSettings(
        dataset=cfg.dataset, partition=cfg.partition, model=cfg.model, train=cfg.train, attack=cfg.attack, seed=cfg.seed
    )


def test_server_app_refuses_bad_config_before_any_work(tmp_path):
    from app.server_app import main

    class NoGrid:
        def __getattr__(self, name):
            raise AssertionError(f"the grid was used ({name}) despite a bad config")

    context = Context(
        run_id=1,
        node_id=0,
        node_config={},
        state=RecordDict(),
        run_config={"overrides": "train.lr=-1", "output-dir": str(tmp_path)},
    )
    with pytest.raises(ConfigError, match="train.lr=-1"):
        main(NoGrid(), context)
    assert list(tmp_path.iterdir()) == []


def test_run_directories_are_never_shared(tmp_path):
    first = new_run_dir(tmp_path, None, "fedavg", "digits")
    second = new_run_dir(tmp_path, None, "fedavg", "digits")
    assert first != second and first.is_dir() and second.is_dir()
    new_run_dir(tmp_path, "mine", "fedavg", "digits")
    with pytest.raises(ConfigError, match="name='mine'.*already holds a run"):
        new_run_dir(tmp_path, "mine", "fedavg", "digits")


# {tmp}: an absolute path (the test's temporary directory, where one is made)
UNSAFE_NAMES = ["../x", "{tmp}/elsewhere", "a/b", "a\\b", ".", "..", "", ".hidden", "x\x00y", "a\nb"]


def test_a_run_name_that_leaves_the_output_root_is_refused_with_its_key():
    with pytest.raises(ConfigError, match=r"name='\.\./x' is invalid: must be a single directory name"):
        load_config("name='../x'")
    with pytest.raises(ConfigError, match=r"sweep\.name='\.\.' is invalid"):
        load_config("sweep.name='..'")
    cfg, _ = load_config("")
    for name in UNSAFE_NAMES:
        with pytest.raises(ConfigError, match=r"^name=.* is invalid"):
            validate(replace(cfg, name=name.format(tmp="/tmp")))
    for name in ("run-1", "fedavg_dirichlet.0.3", "privacy=central,seed=0"):  # the last: a sweep job's
        assert validate(replace(cfg, name=name)).name == name


@pytest.mark.parametrize("name", UNSAFE_NAMES)
def test_the_run_directory_is_made_only_inside_the_output_root(tmp_path, name):
    """Defence in depth: new_run_dir checks the name itself, whoever calls it."""
    root = tmp_path / "root"
    with pytest.raises(ConfigError, match="is invalid"):
        new_run_dir(root, name.format(tmp=tmp_path), "fedavg", "digits")
    assert list(tmp_path.iterdir()) == []
