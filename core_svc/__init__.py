"""splitserve engine core: scheduler, paged KV cache with prefix caching, model runner, sampler.

Entry point: ``core_svc.engine_core.EngineCore``. Layers run engine core -> scheduler -> kv cache manager ->
request, and engine core -> model runner -> models -> ``kernels``.
"""
