"""Configuration: schema (no Hydra), composition of `conf/` (Hydra), validation."""
