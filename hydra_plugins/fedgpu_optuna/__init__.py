"""The Optuna sweeper of `python -m app.sweep` (hydra/sweeper=optuna): Hydra loads sweepers only
from the `hydra_plugins` namespace package; the logic is app/tools/study.py."""
