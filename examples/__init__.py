"""Runnable examples of bringing your own task (docs/examples.md).

Each example is a package that `flwr run` ships with the app (every *.py file of the app
directory), so the ServerApp and the ClientApps import its model and loader by the
dotted paths its preset in conf/example/ names.
"""
