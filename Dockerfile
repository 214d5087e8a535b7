# megatrain: one image for the API, the scheduler and the GPU workers (docker-compose.yml runs it).
#   docker build -t megatrain .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    MEGATRAIN_HOME=/var/lib/megatrain

# tini as PID 1 reaps the torchrun children a cancelled shard leaves behind.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
# Dependencies first, so code edits do not re-download torch: install the package's requirements
# from pyproject.toml against an empty package, then copy the real sources.
COPY pyproject.toml README.md ./
RUN mkdir megatrain && touch megatrain/__init__.py \
    && pip install ".[engine,tracking]" \
    && pip uninstall -y megatrain \
    && rm -rf megatrain build *.egg-info

COPY alembic.ini ./
COPY migrations ./migrations
COPY web ./web
COPY megatrain ./megatrain
# Editable: migrations/ and web/ are found beside the package (megatrain.REPO_ROOT), not in a wheel.
RUN pip install --no-deps -e ".[engine,tracking]"

RUN useradd --create-home --uid 1000 --shell /usr/sbin/nologin megatrain \
    && mkdir -p "$MEGATRAIN_HOME" \
    && chown megatrain:megatrain "$MEGATRAIN_HOME"
USER megatrain
VOLUME ["/var/lib/megatrain"]

EXPOSE 8000
ENTRYPOINT ["/usr/bin/tini", "--"]
# The API in MEGATRAIN_API_WORKERS processes (default 2) with bounded requests (megatrain.api.server):
# header size/count and read timeouts, body read timeouts, keep-alive and concurrency limits.
CMD ["megatrain", "api", "--host", "0.0.0.0", "--port", "8000"]
