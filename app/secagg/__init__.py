"""Secure aggregation (SecAgg+, Bell et al. 2020): the server learns the sum of a cohort's updates,
never one node's. Both sides: the ring encoding and the mask generator; the node's four stages
(`node.py`, imported by the ClientApp); the server's protocol (`server.py`) and the strategy that
aggregates with it (`strategy.py`). docs/privacy.md#secure-aggregation."""
