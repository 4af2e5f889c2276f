# Presto's GPU image: what `system.container_image` names (run.sub starts each experiment's
# ranks in it with pyxis/enroot: srun --container-image, the repository, the logs and
# data.data_dir mounted at their own paths) - or a plain `docker run --gpus all`.
# docs/GPU_QUICKSTART.md has the commands; the environment is requirements-gpu.txt, the CUDA
# install `make venv-gpu` makes: PyPI's torch 2.13.0 brings CUDA 13.0's libraries, cuDNN and
# NCCL as wheels, so the base image needs no CUDA of its own - the host's driver (580 or later)
# is mounted in by the NVIDIA container runtime / enroot's hook.
#
#   docker build -t presto:gpu .
#   docker run --gpus all --ipc=host presto:gpu bash -c "make sources && python -m bench.gpu --out /tmp/check"
#   enroot import -o presto-gpu.sqsh dockerd://presto:gpu             # for system.container_image
FROM ubuntu:24.04

# Python 3.12 (bench.gpu_wheels checks the set resolves for it); a C compiler and Python's
# headers for Triton, which builds a small launcher for the kernels Inductor generates.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 python3-venv python3-dev build-essential ca-certificates make git \
 && rm -rf /var/lib/apt/lists/*

# The enroot/NVIDIA hook mounts the driver when these are set (docker's --gpus sets them too).
ENV NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# The repository's .venv, made as `make venv-gpu` makes it (its stamps too, so make's targets
# take it as installed). Under run.sub the host's checkout is mounted at its own path and
# becomes the working directory; run_and_time.sh takes this interpreter from PYTHON.
WORKDIR /opt/presto
COPY requirements.txt requirements-data.txt requirements-gpu.txt ./
RUN python3 -m venv .venv \
 && .venv/bin/pip install --upgrade pip \
 && .venv/bin/pip install -r requirements-gpu.txt \
 && .venv/bin/pip install --no-deps -r requirements-data.txt \
 && .venv/bin/python -c "import torch; assert torch.version.cuda, 'not a CUDA build'" \
 && touch .venv/.stamp .venv/.stamp-gpu
ENV PATH=/opt/presto/.venv/bin:$PATH PYTHON=/opt/presto/.venv/bin/python

COPY . .
CMD ["python", "-m", "runtime.config", "--help-keys"]
