#!/usr/bin/env bash
# Builds (once) a virtual environment with LiteLLM's proxy, the peer `make bench-peers` measures,
# under the user's cache directory keyed by its version, so every clone on this machine reuses it.
# Prints its path as a shell assignment on the last line (LITELLM_VENV=...).
#
# `litellm[proxy]==X` does not resolve from the package index (its extra pins packages that are not
# published at that version); the proxy's code ships in the plain `litellm` wheel, so this installs
# that wheel pinned and the extra's dependencies unpinned.
set -euo pipefail

LITELLM_VERSION="${LITELLM_VERSION:-1.110.2}"
CACHE_ROOT="${EXAMLOPS_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/examlops}"
VENV="$CACHE_ROOT/litellm-$LITELLM_VERSION"
INDEX="${PIP_INDEX_URL:-https://pypi.org/simple}"
PROXY_DEPS=(apscheduler azure-identity azure-storage-blob backoff backports-zstd boto3 cryptography
  expression fastapi fastapi-sso granian gunicorn hiredis inquirerpy litellm-enterprise
  litellm-proxy-extras mcp orjson polars pydantic pyjwt pynacl python-multipart pyyaml
  restrictedpython rich rq semver soundfile starlette tomlkit uvicorn uvloop websockets)

step() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

if [ ! -f "$VENV/.complete" ]; then
  # Fail early, and say how to fix it, when the package index cannot be reached.
  if ! python3 - "$INDEX/litellm/" <<'PY' 2>/dev/null; then
import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=20).read(1)
PY
    echo "error: the package index $INDEX cannot be reached, so LiteLLM $LITELLM_VERSION cannot be installed." >&2
    echo "  fix: restore network access to it, or point PIP_INDEX_URL at a reachable mirror, then run" >&2
    echo "  'bash scripts/litellm-env.sh' again (it installs into $VENV once)." >&2
    exit 3
  fi
  step "Creating the LiteLLM $LITELLM_VERSION proxy environment in $VENV (one time, a few minutes)"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --progress-bar on -q --upgrade pip 2> >(grep -v '^WARNING: Location' >&2) >&2
  log="$(mktemp)"
  trap 'rm -f "$log"' EXIT
  if ! "$VENV/bin/pip" install --progress-bar on "litellm==$LITELLM_VERSION" "${PROXY_DEPS[@]}" \
      2> >(tee "$log" | grep -v '^WARNING: Location' >&2) >&2; then
    if grep -qiE 'NewConnectionError|ConnectTimeout|Max retries exceeded|Temporary failure in name resolution' "$log"; then
      echo "error: the package index became unreachable during the install; fix the network (or PIP_INDEX_URL) and run again." >&2
    else
      echo "error: pip could not install litellm==$LITELLM_VERSION with the proxy's dependencies (see above)." >&2
    fi
    rm -rf "$VENV"
    exit 3
  fi
  LITELLM_OFFLINE_MODE=true LITELLM_LOCAL_MODEL_COST_MAP=True "$VENV/bin/python" -c "import litellm.proxy.proxy_server" >&2
  touch "$VENV/.complete"
fi

echo "LITELLM_VENV=$VENV"
