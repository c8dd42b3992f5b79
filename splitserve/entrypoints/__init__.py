"""The top floor, above both services (as vLLM's ``vllm/entrypoints`` above its engine): the ``splitserve``
command line, the health check, starting the split stack, the demo, and the test-checkpoint builder."""
