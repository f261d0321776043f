"""`python -m app.report`: the sweep / run report (app/tools/report.py; console script `fedgpu-report`)."""

if __name__ == "__main__":
    from app.tools.report import main

    raise SystemExit(main())
