"""Models; input channels, image size and class count come from the data (`DataSpec`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from app.config.registry import Registry
from app.config.schema import MODELS, ModelConfig
from app.task.data import DataSpec


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

        def block(cin: int, cout: int) -> list[nn.Module]:
            return [
                nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                nn.GroupNorm(min(8, cout), cout),
                nn.ReLU(inplace=True),
            ]

        layers: list[nn.Module] = [*block(spec.channels, w), *block(w, 2 * w)]
        if min(spec.height, spec.width) >= 4:
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

    model = resnet18(num_classes=spec.num_classes)
    model.conv1 = nn.Conv2d(spec.channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    model.avgpool = GlobalAvgPool()
    return model


_MODELS: Registry[Callable[[ModelConfig, DataSpec], nn.Module]] = Registry(
    "model.name",
    MODELS,
    {"cnn": lambda cfg, spec: SmallCNN(spec, cfg.width), "resnet18": lambda cfg, spec: resnet18_small(spec)},
)


def build_model(cfg: ModelConfig, spec: DataSpec) -> nn.Module:
    """The configured model for data of the given shape."""
    return _MODELS[cfg.name](cfg, spec)
