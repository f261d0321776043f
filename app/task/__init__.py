"""The learning task: data, models, the training loop and GPU telemetry (what a user edits)."""
