"""What both services import: environment variables, logging, metrics and tracing set-up, TLS and the API key,
the gRPC servers' shared runtime and error answers, the request checks' wording and phases, model files.

The lowest floor with ``splitserve.stubs``: it imports neither service (``frontend_svc``, ``core_svc``) nor
``splitserve.entrypoints`` (``.importlinter`` checks it)."""
