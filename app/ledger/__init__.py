"""The contribution ledger: a hash-chained record of who contributed what (chain.py), and the
tools that check it and total it per node (`python -m app.ledger verify|report RUN_DIR`)."""
