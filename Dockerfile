# The mtask image: one image for `mtask-worker` and `mtask serve` (docs/deploy.md, "The image's
# contract"). Builds with the legacy builder and with BuildKit alike (no BuildKit-only syntax):
#   docker build -t mtask .
#   docker run mtask        # a worker of the demo handlers (the CMD below)
#   docker run mtask mtask-worker mymodule:registry --uri ... --metrics-host 0.0.0.0 --metrics-port 9100
#   docker run -p 8080:8080 -e MTASK_API_TOKEN=... mtask mtask serve --host 0.0.0.0 --uri ...
# Your handlers: build FROM this image and COPY your module into /app (the working directory,
# which mtask-worker imports from), or `pip install` your package (it goes into /opt/mtask).

# Stage 1: mtask and everything it needs, installed into a virtual environment at /opt/mtask.
FROM python:3.11-slim AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
RUN python -m venv /opt/mtask
COPY pyproject.toml README.md ./
COPY mtask ./mtask
RUN /opt/mtask/bin/pip install --quiet '.[server,cli]' \
    && install -m 0755 mtask/cli/healthcheck.py /opt/mtask/bin/mtask-healthcheck

# Stage 2: that environment only (no compiler, no wheel cache), run as a numeric non-root user.
FROM python:3.11-slim
ENV PATH=/opt/mtask/bin:$PATH PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=build /opt/mtask /opt/mtask
# The user and group are numbers in USER: Kubernetes' runAsNonRoot can only verify a numeric
# user (a name makes the kubelet refuse the pod). /app is the working directory, owned by root:
# the process cannot change its own code.
RUN groupadd --gid 10001 mtask \
    && useradd --uid 10001 --gid 10001 --home-dir /home/mtask --create-home \
       --shell /usr/sbin/nologin mtask \
    && mkdir -p /app
USER 10001:10001
WORKDIR /app
# serve: 8080 (REST API, dashboard, /metrics, /healthz); a worker: 9100 (/metrics, /healthz,
# /readyz) when started with --metrics-port 9100, as the CMD below is.
EXPOSE 8080 9100
# mtask-worker and mtask serve both drain on SIGTERM (Docker's default, stated).
STOPSIGNAL SIGTERM
# Liveness of whichever role runs: mtask-healthcheck reads the container's mtask command line
# and probes /healthz on a worker's --metrics-port, or a MongoDB-free path on serve's --port
# (serve's /healthz is readiness: a database outage must not mark serve unhealthy).
# MTASK_HEALTHCHECK_URL replaces the URL.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 CMD ["mtask-healthcheck"]
# Exec form and no shell: the command is PID 1 and receives SIGTERM itself (mtask-worker drains
# for --grace seconds, releases what it could not finish, and exits 0).
CMD ["mtask-worker", "mtask.demo:registry", "--metrics-host", "0.0.0.0", "--metrics-port", "9100", "--grace", "30"]
