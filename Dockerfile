# The gateway image. It carries the simulated engine (`loadtest sim`) too, so docker-compose.yml
# runs a whole system from one build:
#   docker build -t llm-admission-gateway .
#   docker run -v $PWD/policies/demo.yaml:/etc/gateway/policy.yaml -p 8080:8080 llm-admission-gateway
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# Every dependency ships wheels for linux/amd64 and arm64: no compiler in the image.
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY loadtest ./loadtest
RUN pip install . \
    && useradd --system --create-home --uid 10001 gateway

USER gateway
WORKDIR /home/gateway
EXPOSE 8080
# Policy at /etc/gateway/policy.yaml (mount a file or a ConfigMap there); add --redis-url to
# share admission state with other replicas. --host 0.0.0.0 is for callers; /admin/* stays on
# this port behind its admin key, or add --admin-port N to move it to 127.0.0.1:N (reached with
# `docker exec` or `kubectl port-forward`; --admin-host only to expose it on purpose).
CMD ["gateway", "serve", "--policy", "/etc/gateway/policy.yaml", "--host", "0.0.0.0", "--port", "8080"]
