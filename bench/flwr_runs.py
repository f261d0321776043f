"""What the benchmarks that compare against a baseline through `flwr run` share: a copy of this
app with other components, a wide MLP of a chosen size, and random image data for it."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
COMPONENTS = {"server": "app.server_app:app", "client": "app.client_app:app"}


def app_copy(root: Path, name: str, server: str = "", client: str = "", config: dict[str, Any] | None = None) -> Path:
    """`root/name`: this app's tracked and untracked-but-not-ignored files, with `server` and/or
    `client` ("module:attribute") in pyproject.toml in place of ours, and `config` added to
    [tool.flwr.app.config]. Raises when pyproject.toml no longer names what it replaces."""
    out = root / name
    files = subprocess.run(
        [
            "git",
            "ls-files",
            "--cached",
            "--others",
            "--exclude-standard",
            "app",
            "strategies",
            "conf",
            "bench",
            "examples",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for file in [*files, "pyproject.toml", "README.md"]:
        if (ROOT / file).is_file():
            (out / file).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / file, out / file)
    toml = out / "pyproject.toml"
    text = toml.read_text()
    for kind, theirs in (("server", server), ("client", client)):
        ours = COMPONENTS[kind]
        if not theirs:
            continue
        if f'"{ours}"' not in text:
            raise RuntimeError(f"pyproject.toml no longer names {ours!r}: update bench/flwr_runs.py")
        text = text.replace(f'"{ours}"', f'"{theirs}"')
    anchor = "[tool.flwr.app.config]\n"
    if config:
        if anchor not in text:
            raise RuntimeError("pyproject.toml has no [tool.flwr.app.config]")
        text = text.replace(anchor, anchor + "".join(f"{k} = {json.dumps(v)}\n" for k, v in config.items()), 1)
    toml.write_text(text)
    return out


def two_layer_mlp(input_shape: tuple[int, ...], num_classes: int, hidden: int, hidden2: int) -> nn.Module:
    """in -> hidden -> hidden2 -> classes, ReLUs between: as many parameters as a benchmark needs,
    one matrix product a layer, so a node trains it in milliseconds on a few images."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden2),
        nn.ReLU(),
        nn.Linear(hidden2, num_classes),
    )


def random_images_npz(path: Path, train: int, test: int) -> None:
    """`dataset=npz` data of `train` and `test` random 28x28 images with random labels (seed 0):
    enough to run a round whose cost is the model's size, not its learning."""
    rng = np.random.default_rng(0)
    images = lambda k: rng.integers(0, 256, (k, 28, 28), dtype=np.uint8)  # noqa: E731
    np.savez(path, x=images(train), y=rng.integers(0, 10, train), x_test=images(test), y_test=rng.integers(0, 10, test))
