"""The server's run: set-up, strategy, the round and version loops, checkpoints, results, tracking."""
