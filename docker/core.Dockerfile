# splitserve engine core on CPUs; for NVIDIA GPUs, docker/core-cuda.Dockerfile (docker-compose.gpu.yml and the
# k8s gpu overlay use it). This one installs torch's CPU wheel and g++ for the CPU attention kernel, which the
# image compiles for the build machine's CPU (see below). BASE_IMAGE / TORCH_SPEC / TORCH_INDEX_URL pick another
# Python image or torch build (TORCH_SPEC empty: the base image's torch).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# torch to install first; empty when the base image has it. TORCH_INDEX_URL picks the build.
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPLITSERVE_CACHE_DIR=/models \
    HF_HOME=/models/huggingface

RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
RUN if [ -n "$TORCH_SPEC" ]; then pip install --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"; fi

WORKDIR /opt/splitserve
COPY pyproject.toml README.md ./
COPY splitserve ./splitserve
COPY core_svc ./core_svc
COPY frontend_svc ./frontend_svc
COPY kernels ./kernels
COPY benchmarks ./benchmarks
RUN pip install ".[core]"

RUN useradd --create-home --uid 10001 splitserve \
    && mkdir -p /models && chown splitserve /models
USER splitserve
# The CPU attention kernel into /models/kernels, as the user that runs the core. It is compiled with -march=native
# for the CPU of the machine that builds the image; its file name holds a hash of that CPU's feature flags, so a core
# on another kind of CPU does not load it but compiles its own at its first start (about 20 s; g++ stays in the
# image for that) and keeps it in the volume for every later start. A fresh named volume (compose) starts with
# this build; a Kubernetes volume starts empty, so there the first start compiles.
RUN splitserve build-kernels
VOLUME ["/models"]

# gRPC (engine core) and Prometheus metrics.
EXPOSE 50061 9401
# Readiness: the model is loaded and the core is not draining. A cold start builds the demo model (and the CPU
# kernel on a CPU unlike the build machine's); the start period covers that.
HEALTHCHECK --interval=5s --timeout=4s --start-period=900s --retries=3 \
    CMD ["splitserve", "health", "--address", "127.0.0.1:50061", "--service", "splitserve.engine.v1.EngineCore"]
# The model: SPLITSERVE_MODEL (a folder under /models or a hub id), or --model; unset, the demo model.
ENTRYPOINT ["splitserve"]
CMD ["core", "--host", "0.0.0.0", "--port", "50061", "--metrics-port", "9401", "--shutdown-timeout", "30"]
