"""The Python stubs protoc generates from ``protos/`` (``scripts/generate_protos.py``; committed, not edited):
``splitserve.stubs.engine.v1`` (the frontend ↔ core wire) and ``splitserve.stubs.frontend.v1`` (the public API).
They import nothing of splitserve but each other."""
