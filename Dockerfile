# syntax=docker/dockerfile:1
# The gateway image: `extproc serve` (the same image runs `extproc optimizer` with another command).
# The product only: the tools' packages stay out of the build context (.dockerignore) and the `tools`
# extra (matplotlib, tqdm) out of the install; tests/unit/test_dockerfile.py runs the image's commands
# from the wheel this context builds, tests/unit/test_product_imports.py keeps the product from needing them.
#   docker build -t extproc:0.1.0 .
#   docker run -v $PWD/gateway.yaml:/etc/extproc/gateway.yaml -p 50052:50052 extproc:0.1.0
# The install step is the one `make setup` runs in CI (`pip install` of this project's pyproject.toml),
# without the test extra; tests/unit/test_dockerfile.py keeps the two in step.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/extproc
ENV PATH=/opt/extproc/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY extproc ./extproc
RUN python -m pip install -q --upgrade pip && python -m pip install -q .

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/extproc/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
RUN groupadd --system --gid 10001 extproc \
 && useradd --system --uid 10001 --gid extproc --no-create-home --shell /usr/sbin/nologin extproc
COPY --from=build /opt/extproc /opt/extproc
USER 10001:10001
EXPOSE 50052 9090
# gRPC health of the ext_proc server itself (the same check Kubernetes' grpc probes make), plaintext on
# port 50052: with --tls-cert or another --port, override it (or use the admin port's /healthz).
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import grpc, sys; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; ch = grpc.insecure_channel('127.0.0.1:50052'); r = g.HealthStub(ch).Check(h.HealthCheckRequest(), timeout=2); sys.exit(r.status != h.HealthCheckResponse.SERVING)"]
ENTRYPOINT ["extproc", "serve"]
CMD ["--config", "/etc/extproc/gateway.yaml", "--host", "0.0.0.0", "--admin-host", "0.0.0.0"]
