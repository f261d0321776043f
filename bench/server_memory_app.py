"""What `bench/server_memory.py` runs under `flwr run`: the wide MLP (`model=custom
model._target_=bench.server_memory_app.wide_mlp`, ≥ 50 M parameters) and `flower_app`, a minimal
ServerApp that trains the same model with Flower's own `flwr.serverapp.strategy.FedAvg` and our
ClientApp, the baseline whose server memory grows with the cohort.

Imported by every ClientApp (for the model): only torch at the top.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from torch import nn

from bench.flwr_runs import two_layer_mlp


def wide_mlp(input_shape: tuple[int, ...], num_classes: int, hidden: int = 8192, hidden2: int = 5376) -> nn.Module:
    """784 -> 8192 -> 5376 -> classes: 50.5 M parameters (202 MB in float32) at the defaults."""
    return two_layer_mlp(input_shape, num_classes, hidden, hidden2)


flower_app = ServerApp()


@flower_app.main()
def flower_main(grid: Grid, context: Context) -> None:
    """Flower's FedAvg.start over the same config: our ClientApp's settings in every task's config,
    the model built as `model=custom` builds it (same seed), `federation.rounds` rounds."""
    from flwr.serverapp.strategy import FedAvg

    from app.config.compose import load_config
    from app.protocol import ROUNDS_KEY, to_client_record
    from app.task.data import DataSpec, spec_to_record

    cfg, _ = load_config(str(context.run_config.get("overrides", "")))
    spec = DataSpec((1, 28, 28), 10)
    torch.manual_seed(cfg.seed)
    model = wide_mlp(spec.input_shape, spec.num_classes, **cfg.model.kwargs)
    f = cfg.federation
    strategy = FedAvg(
        fraction_train=f.fraction_train,
        fraction_evaluate=0.0,
        min_train_nodes=f.min_train_nodes,
        min_available_nodes=f.min_available_nodes,
    )
    config = ConfigRecord({**to_client_record(cfg), **spec_to_record(spec), ROUNDS_KEY: f.rounds})
    strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), train_config=config, num_rounds=f.rounds)
