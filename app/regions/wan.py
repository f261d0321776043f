"""A region's update on the wide-area link (`topology.wan_compression`): re-encoded by its
aggregator with app/compression's codecs and the aggregator's own error-feedback residual, so
what int8 or a 16-bit float rounds away from one round's regional update is sent in the next
(`with_error_feedback`), exactly as a node does on its uplink."""

from __future__ import annotations

import torch

from app.compression.codecs import decode, payload_nbytes, with_error_feedback

Update = dict[str, torch.Tensor]


class WanCodec:
    """`WanLeg` of strategies/regional.py: (region, update) -> (decoded update, bytes on the WAN).

    The residuals are each aggregator's state, kept across rounds and in the checkpoint
    (`state_dict`); int8's stochastic rounding draws from a generator seeded by the run."""

    def __init__(self, mode: str, seed: int) -> None:
        self.mode = mode
        self.generator = torch.Generator().manual_seed(seed)
        self.residuals: dict[int, Update] = {}

    def __call__(self, region: int, update: Update) -> tuple[Update, int]:
        parts, self.residuals[region] = with_error_feedback(
            update, self.residuals.get(region), self.mode, generator=self.generator
        )
        return decode(parts, update, self.mode), payload_nbytes(parts)

    def state_dict(self) -> dict[str, object]:
        """The residuals and the rounding generator's state: a resumed run rounds as the run it continues."""
        return {
            "mode": self.mode,
            "residuals": {str(r): v for r, v in self.residuals.items()},
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("mode") != self.mode:
            raise ValueError(f"checkpoint holds WAN residuals of {state.get('mode')}, not {self.mode}")
        self.residuals = {int(r): v for r, v in state.get("residuals", {}).items()}
        if "generator" in state:
            self.generator.set_state(state["generator"])
