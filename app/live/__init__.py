"""The live run page (`python -m app.live RUN_DIR_OR_ROOT`, `fedgpu-live`): every run under a
results root, updated as rows arrive, in a browser, without Docker (docs/monitoring.md#the-live-run-page)."""
