"""`python -m app.supervise -- name=... [overrides]`: a run that recovers itself (app/tools/supervise.py;
console script `fedgpu-run`)."""

if __name__ == "__main__":
    from app.tools.supervise import main

    raise SystemExit(main())
