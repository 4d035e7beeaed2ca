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

COPY pyproject.toml README.md manage.py ./
COPY fleet ./fleet
COPY accounts ./accounts
COPY devices ./devices
COPY training ./training
COPY frontend ./frontend
COPY edge_agent ./edge_agent
RUN pip install '.[server,s3]' && rm -rf build

# Static files are collected at build time; placeholders only, no service is contacted.
ENV STATIC_ROOT=/app/staticfiles
RUN DATABASE_URL=postgresql://build@localhost/build REDIS_URL=redis://localhost:6379/0 \
    python manage.py collectstatic --noinput --verbosity 0

ENV FLEET_ENV=production \
    FLEET_DATA_DIR=/data \
    PROMETHEUS_MULTIPROC_DIR=/tmp/prometheus
USER fleet
EXPOSE 8000
CMD ["sh", "-c", "rm -rf $PROMETHEUS_MULTIPROC_DIR && mkdir -p $PROMETHEUS_MULTIPROC_DIR && exec uvicorn fleet.asgi:application --host 0.0.0.0 --port 8000 --workers ${WEB_CONCURRENCY:-2} --ws wsproto --ws-ping-interval 60 --ws-ping-timeout 30 --loop uvloop --http httptools --lifespan off --no-access-log --proxy-headers --forwarded-allow-ips='*'"]
