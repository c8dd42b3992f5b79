"""splitserve: the command line (``splitserve.cli``), test-checkpoint tooling, and the generated wire stubs
(``splitserve.engine.v1``, from ``protos/``). Importing this package imports nothing else."""

__version__ = "0.1.0"
