#!/usr/bin/env bash
# Installs the peers that `python -m bench.proxy` compares the sidecar with, by package name only:
#   nginx         Debian package (apt-get), run with `-c CONF -p PREFIX`, no root paths
#   vllm-router   PyPI, into its own venv   bench/.peers/vllm-router
#   LiteLLM       PyPI `litellm[proxy]`, into its own venv   bench/.peers/litellm
# and psutil into the benchmark's own environment (the one running this script's PYTHON).
# bench/.peers/ is gitignored: venvs are never committed. Idempotent: re-running skips what is there.
#
#   bash bench/peers.sh            # all of them
#   bash bench/peers.sh nginx      # only some: any of nginx vllm-router litellm psutil
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PEERS="${SPECGATE_PEERS_DIR:-$ROOT/bench/.peers}"
PYTHON="${PYTHON:-python3}"
VLLM_ROUTER_VERSION="${VLLM_ROUTER_VERSION:-0.1.17}"
LITELLM_VERSION="${LITELLM_VERSION:-1.108.7}"
mkdir -p "$PEERS"

want() { [ $# -eq 0 ] && return 0; local w; for w in "${ONLY[@]}"; do [ "$w" = "$1" ] && return 0; done; return 1; }
ONLY=("$@")
[ ${#ONLY[@]} -eq 0 ] && ONLY=(nginx vllm-router litellm psutil)

venv() {  # venv DIR PACKAGE...
  local dir="$1"; shift
  [ -x "$dir/bin/python" ] || "$PYTHON" -m venv "$dir"
  "$dir/bin/python" -m pip install --quiet --disable-pip-version-check "$@"
}

if want nginx; then
  if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx >/dev/null
    # the Debian package starts a system-wide nginx on :80; the benchmark runs its own
    (command -v systemctl >/dev/null && systemctl stop nginx 2>/dev/null) || nginx -s quit 2>/dev/null || true
  fi
  echo "nginx: $( (command -v nginx || echo /usr/sbin/nginx) )"
fi
if want vllm-router; then
  [ -x "$PEERS/vllm-router/bin/vllm-router" ] || venv "$PEERS/vllm-router" "vllm-router==$VLLM_ROUTER_VERSION"
  echo "vllm-router: $PEERS/vllm-router/bin/vllm-router"
fi
if want litellm; then
  [ -x "$PEERS/litellm/bin/litellm" ] || venv "$PEERS/litellm" "litellm[proxy]==$LITELLM_VERSION"
  echo "litellm: $PEERS/litellm/bin/litellm"
fi
if want psutil; then
  "$PYTHON" -c "import psutil" 2>/dev/null || "$PYTHON" -m pip install --quiet --disable-pip-version-check psutil
  echo "psutil: $("$PYTHON" -c 'import psutil; print(psutil.__version__)')"
fi
