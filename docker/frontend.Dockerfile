# splitserve frontend: tokenization, chat templates, detokenization, stop strings. No torch: the frontend never
# imports it, so this image is small and starts fast. It reads the model's tokenizer files (the shared /models
# volume, or a hub id) and reaches the cores over gRPC.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPLITSERVE_CACHE_DIR=/models \
    HF_HOME=/models/huggingface

WORKDIR /opt/splitserve
COPY pyproject.toml README.md ./
COPY splitserve ./splitserve
COPY core_svc ./core_svc
COPY frontend_svc ./frontend_svc
COPY kernels ./kernels
COPY benchmarks ./benchmarks
# The base dependencies only (no "core" extra): no torch.
RUN pip install . && ! python -c "import torch" 2>/dev/null

RUN useradd --create-home --uid 10001 splitserve \
    && mkdir -p /models && chown splitserve /models
USER splitserve
VOLUME ["/models"]

# gRPC (public API) and Prometheus metrics.
EXPOSE 50051 8000 9400
# Readiness: some core is reachable and the frontend is not draining.
HEALTHCHECK --interval=5s --timeout=4s --start-period=60s --retries=3 \
    CMD ["splitserve", "health", "--address", "127.0.0.1:50051", "--service", "splitserve.frontend.v1.Generation"]
ENTRYPOINT ["splitserve"]
CMD ["frontend", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9400", "--core", "dns:///core:50061", \
     "--shutdown-timeout", "30", "--http-port", "8000"]
