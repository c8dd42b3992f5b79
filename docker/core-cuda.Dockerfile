# splitserve engine core for NVIDIA GPUs (docker-compose.gpu.yml and the k8s gpu overlay run it):
#   docker build -f docker/core-cuda.Dockerfile -t splitserve/core:0.1.0-cuda .
#   docker build -f docker/core-cuda.Dockerfile --build-arg FLASH_ATTN=1 -t splitserve/core:0.1.0-cuda-fa .
# A file of its own rather than build arguments of core.Dockerfile: it starts from PyTorch's CUDA image (torch built
# for CUDA, and Triton, which torch's CUDA build brings and which compiles the default attention backend's kernels),
# needs no CPU attention kernel, and builds the optional flash-attn in a stage of its own on the matching -devel image.
#
# flash-attn is off by default (FLASH_ATTN=0): the default attention backend is triton; upstream flash-attn reads a
# paged KV cache only in blocks of a multiple of 256 tokens, so auto picks it only with --block-size 256 (which
# coarsens prefix caching); and without a prebuilt wheel for this torch and CUDA it compiles for an hour or more.
# FLASH_ATTN=1 builds it (a prebuilt wheel when flash-attn's setup finds one, else nvcc with MAX_JOBS jobs).
# The three images must agree: the same torch, CUDA and Python (the pytorch/pytorch tags below do).
ARG BASE_IMAGE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime
ARG DEVEL_IMAGE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-devel
ARG FLASH_ATTN=0

FROM ${DEVEL_IMAGE} AS flash-attn-1
ARG FLASH_ATTN_SPEC="flash-attn>=2.6,<3"
ARG MAX_JOBS=4
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install packaging ninja wheel \
    && MAX_JOBS="$MAX_JOBS" pip wheel --no-build-isolation --no-deps --wheel-dir /wheels "$FLASH_ATTN_SPEC"

FROM ${BASE_IMAGE} AS flash-attn-0
RUN mkdir -p /wheels

# Only the stage FLASH_ATTN names is built (BuildKit skips the other, and its -devel image).
FROM flash-attn-${FLASH_ATTN} AS wheels

FROM ${BASE_IMAGE}

# Triton's kernels compile on first use into TRITON_CACHE_DIR, on the models volume: later starts reuse them.
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPLITSERVE_CACHE_DIR=/models \
    HF_HOME=/models/huggingface \
    TRITON_CACHE_DIR=/models/triton

# Triton builds a small C launcher per kernel signature with the system's C compiler; the runtime image has none.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/splitserve
COPY --from=wheels /wheels /tmp/wheels
RUN if ls /tmp/wheels/*.whl >/dev/null 2>&1; then pip install /tmp/wheels/*.whl; fi && rm -rf /tmp/wheels
COPY pyproject.toml README.md ./
COPY splitserve ./splitserve
COPY core_svc ./core_svc
COPY frontend_svc ./frontend_svc
COPY kernels ./kernels
COPY benchmarks ./benchmarks
# The core extra keeps the image's torch (its range takes what is installed). The check fails the build on a base
# image whose torch is not a CUDA build, or whose Triton is missing.
RUN pip install ".[core]" \
    && python -c "import torch, triton; assert torch.version.cuda, 'torch is a CPU build'; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'triton', triton.__version__)"

RUN useradd --create-home --uid 10001 splitserve \
    && mkdir -p /models && chown splitserve /models
USER splitserve
VOLUME ["/models"]

# gRPC (engine core) and Prometheus metrics.
EXPOSE 50061 9401
# Readiness: the model is loaded and the core is not draining. A cold start downloads the model and compiles
# Triton's kernels; the start period covers that.
HEALTHCHECK --interval=5s --timeout=4s --start-period=900s --retries=3 \
    CMD ["splitserve", "health", "--address", "127.0.0.1:50061", "--service", "splitserve.engine.v1.EngineCore"]
# The model: SPLITSERVE_MODEL (a folder under /models or a hub id), or --model; unset, the demo model.
ENTRYPOINT ["splitserve"]
CMD ["core", "--device", "cuda", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.9", "--host", "0.0.0.0", \
     "--port", "50061", "--metrics-port", "9401", "--shutdown-timeout", "30"]
