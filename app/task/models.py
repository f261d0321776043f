"""Models: the built-in image models, any torchvision classifier by name, or the user's own
(`model=custom`); their input shape and output count come from the data (`DataSpec`). Also
what the server checks before round 1 (the model takes the data, pretrained weights fit) and
which parameters are trained and sent (`model.trainable`)."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable

import torch
from torch import nn

from app.config.registry import Registry
from app.config.schema import MODELS, ConfigError, ModelConfig
from app.task.data import DataSpec
from app.task.user_code import call


class GlobalAvgPool(nn.Module):
    """`AdaptiveAvgPool2d(1)` as a mean over H and W: the same values, and a backward that is
    deterministic on CUDA (adaptive pooling's CUDA backward accumulates with atomics, which
    `torch.use_deterministic_algorithms` refuses). No parameters, so state_dicts are unchanged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3), keepdim=True)


class SmallCNN(nn.Module):
    """Three 3x3 conv blocks and global average pooling.

    GroupNorm instead of BatchNorm: no running statistics to average across clients
    with different label mixes, and Opacus (DP-SGD) accepts it as is.
    """

    def __init__(self, spec: DataSpec, width: int = 32) -> None:
        super().__init__()
        w = width
        channels, height, width_px = spec.image_shape("cnn")

        def block(cin: int, cout: int) -> list[nn.Module]:
            return [
                nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                nn.GroupNorm(min(8, cout), cout),
                nn.ReLU(inplace=True),
            ]

        layers: list[nn.Module] = [*block(channels, w), *block(w, 2 * w)]
        if min(height, width_px) >= 4:
            layers.append(nn.MaxPool2d(2))
        layers += [*block(2 * w, 4 * w), GlobalAvgPool(), nn.Flatten(), nn.Linear(4 * w, spec.num_classes)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def resnet18_small(spec: DataSpec) -> nn.Module:
    """torchvision ResNet-18 for 32x32 inputs: 3x3 stride-1 stem, no max-pool.

    torchvision is imported here, not at module load: a deployed SuperNode starts a
    fresh ClientApp process per message, and the import costs ~1.2 s of every one.
    """
    from torchvision.models import resnet18

    channels, _, _ = spec.image_shape("resnet18")
    model = resnet18(num_classes=spec.num_classes)
    model.conv1 = nn.Conv2d(channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    model.avgpool = GlobalAvgPool()
    return model


def torchvision_model(cfg: ModelConfig, spec: DataSpec) -> nn.Module:
    """`torchvision.models.get_model(arch)` with random weights, `num_classes` outputs and its first
    convolution taking the data's channels (pretrained weights: `model.init_weights`)."""
    from torchvision import models

    channels, _, _ = spec.image_shape("torchvision")
    known = models.list_models(module=models)  # the classification models
    if cfg.arch not in known:
        raise ConfigError(
            f"model.arch={cfg.arch!r} is not a torchvision classification model; "
            f"small ones: mobilenet_v3_small, squeezenet1_1, shufflenet_v2_x0_5, resnet18 (all: {len(known)})"
        )
    model = models.get_model(cfg.arch, weights=None, num_classes=spec.num_classes)
    name, conv = next((n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d))
    if conv.in_channels != channels:
        parent = model.get_submodule(name.rpartition(".")[0])
        setattr(
            parent,
            name.rpartition(".")[2],
            nn.Conv2d(
                channels,
                conv.out_channels,
                conv.kernel_size,  # type: ignore[arg-type]
                conv.stride,  # type: ignore[arg-type]
                conv.padding,  # type: ignore[arg-type]
                bias=conv.bias is not None,
            ),
        )
    return model


def custom_model(cfg: ModelConfig, spec: DataSpec) -> nn.Module:
    """The user's callable (`model._target_`) with its keyword arguments, and `spec`,
    `input_shape` or `num_classes` when its signature names them."""
    offered = {"spec": spec, "input_shape": spec.input_shape, "num_classes": spec.num_classes}
    model = call("model._target_", str(cfg.target), cfg.kwargs, offered)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model._target_={cfg.target} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


_MODELS: Registry[Callable[[ModelConfig, DataSpec], nn.Module]] = Registry(
    "model.name",
    MODELS,
    {
        "cnn": lambda cfg, spec: SmallCNN(spec, cfg.width),
        "resnet18": lambda cfg, spec: resnet18_small(spec),
        "torchvision": torchvision_model,
        "custom": custom_model,
        "hf": lambda cfg, spec: _hf_model(cfg, spec),
    },
)


def _hf_model(cfg: ModelConfig, spec: DataSpec) -> nn.Module:
    from app.task.hf import hf_model  # transformers: imported only for model=hf

    return hf_model(cfg, spec)


def build_model(cfg: ModelConfig, spec: DataSpec) -> nn.Module:
    """The configured model for data of the given shape."""
    return _MODELS[cfg.name](cfg, spec)


def model_key(cfg: ModelConfig) -> str:
    """The config key that chose the model, for messages."""
    return {
        "custom": f"model._target_={cfg.target}",
        "torchvision": f"model.arch={cfg.arch}",
        "hf": f"model.path={cfg.path}" if cfg.path else "model=hf (model.config)",
    }.get(cfg.name, f"model.name={cfg.name}")


def check_fits(model: nn.Module, cfg: ModelConfig, spec: DataSpec, inputs: torch.Tensor) -> None:
    """The model must map a batch of the data's examples (`inputs`, as the loop feeds them) to
    one row of `num_classes` outputs each; checked on the server before round 1."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(inputs)
    except Exception as err:  # noqa: BLE001 - whatever the model raises, say which data it got
        raise ConfigError(
            f"{model_key(cfg)} cannot take this data's examples (shaped {spec.input_shape}, dtype {inputs.dtype}): "
            f"{type(err).__name__}: {err}"
        ) from err
    finally:
        model.train(was_training)
    if spec.causal_lm:
        ok = isinstance(out, torch.Tensor) and tuple(out.shape[:2]) == tuple(inputs.shape) and out.dim() == 3
        if not ok or out.shape[2] < spec.num_classes:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ConfigError(
                f"{model_key(cfg)} maps token blocks {tuple(inputs.shape)} to {got}; expected N x T x vocabulary "
                f"with a vocabulary of at least the {spec.num_classes} token ids the data uses"
            )
        return
    expected = (len(inputs), spec.num_classes)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        what = "targets per example" if spec.multilabel else "classes"
        raise ConfigError(
            f"{model_key(cfg)} maps {len(inputs)} examples to {got}; expected {expected} (one logit per {what})"
        )


def load_init_weights(model: nn.Module, path: str) -> None:
    """Start from a state_dict file, loaded weights-only (a pickle could run code); every key and
    shape must match the model, and the refusal names the ones that do not."""
    key = f"model.init_weights={path}"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ConfigError(
            f"{key}: not a weights-only file (torch.load(weights_only=True) refused it: {str(err).splitlines()[0]}); "
            "save it with torch.save(model.state_dict(), path)"
        ) from err
    except (OSError, RuntimeError) as err:
        raise ConfigError(f"{key}: cannot read it: {err}") from err
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"{key}: expected a state_dict (a dict of tensors), found a {type(state).__name__}")
    own = model.state_dict()
    problems = [f"missing {k}" for k in sorted(own.keys() - state.keys())]
    problems += [f"unexpected {k}" for k in sorted(state.keys() - own.keys())]
    problems += [
        f"{k}: file {tuple(state[k].shape)}, model {tuple(own[k].shape)}"
        for k in sorted(own.keys() & state.keys())
        if state[k].shape != own[k].shape
    ]
    if problems:
        more = f" and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise ConfigError(f"{key} does not fit the model: {'; '.join(problems[:8])}{more}")
    model.load_state_dict(state)


def matches(key: str, prefixes: Iterable[str]) -> bool:
    """`key` is `prefix` or lies under it at a `.` boundary (`fc` covers `fc.weight`, not `fc2.weight`)."""
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def trainable_keys(model: nn.Module, prefixes: list[str]) -> list[str]:
    """The state_dict keys trained, sent and aggregated (`model.trainable`; [] = all). A prefix
    that covers no parameter is refused with the model's top-level modules named."""
    keys = list(model.state_dict())
    if getattr(model, "adapted", False):  # peft froze the base: its adapters are what trains
        from app.task.hf import adapter_keys

        if prefixes:
            raise ConfigError("model.trainable: model.peft=lora chooses what trains (its adapters); leave it []")
        return adapter_keys(model)  # type: ignore[arg-type]
    if not prefixes:
        return keys
    params = [n for n, _ in model.named_parameters()]
    unused = [p for p in prefixes if not any(matches(n, [p]) for n in params)]
    if unused:
        top = sorted({n.split(".")[0] for n in params})
        raise ConfigError(
            f"model.trainable={prefixes}: {unused} cover no parameter; the model's modules are {top} "
            "(prefixes end at a '.', e.g. fc or net.9)"
        )
    return [k for k in keys if matches(k, prefixes)]


def freeze(model: nn.Module, prefixes: list[str]) -> None:
    """Train only the parameters under `prefixes` (all when empty)."""
    if prefixes:
        for name, param in model.named_parameters():
            param.requires_grad_(matches(name, prefixes))
