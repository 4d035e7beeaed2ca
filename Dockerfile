# The production image: web (uvicorn, ASGI), worker and beat all run from it (see docker-compose.yml).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --create-home --uid 10001 fleet && mkdir -p /app /data && chown fleet:fleet /data
WORKDIR /app

# torch first, the CPU build, pinned: nothing later may resolve a multi-GB CUDA build.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

COPY pyproject.toml setup.py README.md manage.py ./
COPY core ./core
COPY fleet ./fleet
COPY demo ./demo
COPY accounts ./accounts
COPY devices ./devices
COPY training ./training
COPY frontend ./frontend
COPY edge_agent ./edge_agent
# server: what web, worker and beat need (scikit-learn included); not `local` (embedded PostgreSQL and Redis).
# gcc builds the workers' compiled loops (training/federation/strategies/sum_kernel.c), then goes.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && pip install '.[server,s3]' && rm -rf build \
    && apt-get purge -y --auto-remove gcc libc6-dev && rm -rf /var/lib/apt/lists/*

# Static files are collected at build time; placeholders only, no service is contacted.
ENV STATIC_ROOT=/app/staticfiles
RUN DATABASE_URL=postgresql://build@localhost/build REDIS_URL=redis://localhost:6379/0 \
    python manage.py collectstatic --noinput --verbosity 0

ENV FLEET_ENV=production \
    FLEET_DATA_DIR=/data \
    PROMETHEUS_MULTIPROC_DIR=/tmp/prometheus
USER fleet
EXPOSE 8000
# uvicorn with the flags in fleet/serve.py (the launcher's too); behind the load balancer, X-Forwarded-* is trusted.
CMD ["sh", "-c", "rm -rf $PROMETHEUS_MULTIPROC_DIR && mkdir -p $PROMETHEUS_MULTIPROC_DIR && exec python -m fleet.serve --host 0.0.0.0 --port 8000 --workers ${WEB_CONCURRENCY:-2} --forwarded-allow-ips='*'"]
