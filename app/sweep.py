"""`python -m app.sweep`: the sweep command (app/tools/sweep.py; console script `fedgpu-sweep`).

The task function runs from the importable module, not from __main__: launchers that run
jobs in other processes (joblib, submitit) import app.tools.sweep, which registers the
resolvers the job directories need.
"""

if __name__ == "__main__":
    from app.tools.sweep import cli

    cli()
