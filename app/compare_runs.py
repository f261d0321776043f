"""`python -m app.compare_runs`: accuracy against wall time for several runs (app/tools/compare_runs.py)."""

if __name__ == "__main__":
    from app.tools.compare_runs import main

    main()
