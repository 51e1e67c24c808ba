# syntax=docker/dockerfile:1
#
# prime-train on a GPU node: the supervisor and the training engine (CUDA torch) in one venv, vLLM in a venv of
# its own (it pins its own torch and transformers), at a fixed path:
#
#   /opt/prime-train   the project:  prime-train, python (torch with CUDA, transformers, boto3, wandb, pyarrow)
#   /opt/vllm          vLLM:         inference.python = "/opt/vllm/bin/python" (also found with it unset)
#
#   docker build -t prime-train .
#   docker run --gpus all --ipc=host -v "$PWD:/workspace" prime-train run configs/tiny-rl.toml
#
# --ipc=host: torch's DataLoader workers and NCCL share memory through /dev/shm, which docker caps at 64 MB.
# Built by .github/workflows/image.yml; checked without docker by tests/test_packaging.py (hadolint, and
# BuildKit's own Dockerfile parser).

# CUDA 13.0: the CUDA build PyPI's torch wheels have used since torch 2.9 (cu130), which needs a driver >= 580.
# The base image holds no CUDA libraries of note: torch's and vLLM's wheels bring their own.
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-base-ubuntu24.04
FROM ${CUDA_IMAGE}

# the newest torch the engine is tested on (scripts/test-torch-versions.sh); vLLM's own comes with vLLM
ARG TORCH_VERSION=2.13.0
# empty: the vLLM version prime-train tests against (prime_train/rl/vllm_server.py GPU_REQUIREMENT)
ARG VLLM_REQUIREMENT=""

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Python 3.12 (Ubuntu 24.04's). gcc and the Python headers: Triton compiles its kernels' launchers at run time
# (torch.compile, and vLLM). git: pip requirements given as git URLs. Unpinned: the Ubuntu release pins them.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev gcc g++ git ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# Only what the package is built from (.dockerignore keeps the rest out of the build context too).
COPY pyproject.toml README.md /src/prime-train/
COPY prime_train /src/prime-train/prime_train

# The project. torch first and pinned: a bare requirement would take whatever is newest.
RUN python3 -m venv /opt/prime-train \
    && /opt/prime-train/bin/pip install "torch==${TORCH_VERSION}" \
    && /opt/prime-train/bin/pip install "/src/prime-train[engine,s3,parquet,wandb]" \
    && /opt/prime-train/bin/prime-train --version

ENV PATH=/opt/prime-train/bin:$PATH

# vLLM in its own venv, installed the way `prime-train inference install` installs it (no GPU at build time: --cuda
# says which build); it checks that the result has a server to start.
RUN prime-train inference install --cuda --prefix /opt/vllm ${VLLM_REQUIREMENT:+--requirement "$VLLM_REQUIREMENT"}

# Not root (uid 1001: Ubuntu's own `ubuntu` user has 1000). The managed vLLM venv `prime-train inference install`
# would make for this user is the one above, so configs that leave inference.python unset find it.
RUN useradd --uid 1001 --create-home --shell /bin/bash trainer \
    && mkdir -p /home/trainer/.local/share/prime-train /workspace \
    && ln -s /opt/vllm /home/trainer/.local/share/prime-train/vllm \
    && chown -R trainer:trainer /home/trainer /workspace
USER 1001:1001
WORKDIR /workspace

ENTRYPOINT ["prime-train"]
CMD ["--help"]
