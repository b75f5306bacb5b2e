# The mtask image: one image for `mtask-worker` and `mtask serve`.
#   docker build -t mtask .
#   docker run mtask mtask-worker mymodule:registry --uri ... --metrics-host 0.0.0.0 --metrics-port 9100
#   docker run -p 8080:8080 -e MTASK_API_TOKEN=... mtask mtask serve --host 0.0.0.0 --uri ...
# Your handlers: build FROM this image and COPY your module into /app (the working directory,
# which mtask-worker imports from), or install your package into it.

# Stage 1: build the wheel of mtask and of everything it needs (nothing is installed at start).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY mtask ./mtask
RUN pip wheel --no-cache-dir --wheel-dir /wheels '.[server,cli]'

# Stage 2: install those wheels only, run as a non-root user.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels 'mtask[server,cli]' \
    && useradd --create-home --uid 10001 mtask
USER mtask
WORKDIR /app
# serve: 8080 (REST API, dashboard, /metrics, /healthz); a worker: 9100 (/metrics, /healthz, /readyz).
EXPOSE 8080 9100
# Probes /healthz of serve by default; a worker's service sets MTASK_HEALTHCHECK_URL to
# http://127.0.0.1:9100/healthz (its --metrics-port).
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ.get('MTASK_HEALTHCHECK_URL', 'http://127.0.0.1:8080/healthz'), timeout=2)"]
# Exec form and no shell: the command is PID 1 and receives SIGTERM itself (mtask-worker drains
# for --grace seconds, releases what it could not finish, and exits 0).
CMD ["mtask-worker", "mtask.demo:registry", "--metrics-host", "0.0.0.0", "--metrics-port", "9100", "--grace", "30"]
