"""Compressed uplink: the update codecs (`codecs.py`: pure torch) and a reply's packing and
unpacking around them (`packing.py`), shared by the ClientApp and the server (docs/compression.md)."""
