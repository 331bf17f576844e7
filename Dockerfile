# The specgate image: control plane, sidecar, dashboard and load generator
# (one image, the command picks the part; see docker-compose.yml).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Dependencies first, in their own layer, so that a source change does not reinstall them:
# an editable install of empty packages resolves and installs everything pyproject.toml names.
COPY pyproject.toml README.md ./
RUN mkdir -p policies controlplane sidecar dashboard testbed \
    && touch policies/__init__.py controlplane/__init__.py sidecar/__init__.py dashboard/__init__.py \
       testbed/__init__.py \
    && pip install -e .

# Editable on purpose: the control plane finds alembic.ini and migrations/ beside its
# packages at the source root, which a plain wheel install would leave behind.
COPY . .

# The key directories are the mount points of the compose file's key volumes: an empty volume takes their
# owner and mode 700 on first use.
RUN useradd --uid 10001 --home-dir /var/lib/specgate --shell /usr/sbin/nologin specgate \
    && mkdir -p /var/lib/specgate/keys/admin /var/lib/specgate/keys/worker /var/lib/specgate/sidecar \
    && chown -R specgate:specgate /var/lib/specgate \
    && chmod 700 /var/lib/specgate/keys /var/lib/specgate/keys/admin /var/lib/specgate/keys/worker
USER specgate

EXPOSE 8080 8501 9000
CMD ["specgate", "--help"]
