#!/usr/bin/env bash
# The router's streaming path side by side with its peers (nginx, vllm-router, sglang-router) and
# a direct connection, in one run: see scripts/bench_peers.py for what is measured.
#
#   scripts/bench_peers.sh [--quick] [--reps 2] [--out DIR] ...   (all options: --help)
#
# The peers and the harness's own tools install once into a cache outside the repository,
# ${SPECROUTE_PEERS_CACHE:-/var/cache/specroute/peers}, reused while its marker file is there.
# specroute itself runs from this checkout's .venv (else the `specroute` on PATH).
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE=${SPECROUTE_PEERS_CACHE:-/var/cache/specroute/peers}
MARKER="$CACHE/installed-v2"
VLLM_ROUTER=vllm-router==0.1.17
SGLANG_ROUTER=sglang-router==0.3.2
TOOLS=(aiohttp==3.14.5 uvicorn==0.54.0 uvloop==0.23.0 httptools==0.9.0 httpx==0.28.1 py-spy==0.4.3 granian==2.8.7)

install() {
    local started=$SECONDS
    echo "installing the peers into $CACHE (once)" >&2
    mkdir -p "$CACHE"
    # Each Python tool in its own venv, so that their dependencies never meet.
    for spec in "$VLLM_ROUTER" "$SGLANG_ROUTER"; do
        local name=${spec%%==*}
        rm -rf "${CACHE:?}/$name"
        python3 -m venv "$CACHE/$name"
        "$CACHE/$name/bin/pip" install -q --disable-pip-version-check "$spec" 2>&1 | grep -v "is ignored" >&2 || true
        "$CACHE/$name/bin/$name" --help > /dev/null
    done
    rm -rf "${CACHE:?}/tools"
    python3 -m venv "$CACHE/tools"
    "$CACHE/tools/bin/pip" install -q --disable-pip-version-check "${TOOLS[@]}" 2>&1 | grep -v "is ignored" >&2 || true
    "$CACHE/tools/bin/python" -c "import aiohttp, uvicorn, uvloop, httptools, httpx, granian"
    # nginx from Debian: the binary is run in the foreground with a generated configuration, so the
    # package's own service is never used (Debian's policy-rc.d, where present, keeps it stopped).
    if ! command -v nginx > /dev/null && [ ! -x /usr/sbin/nginx ]; then
        apt-get install -y -q --no-install-recommends nginx-light > /dev/null \
            || { apt-get update -q > /dev/null && apt-get install -y -q --no-install-recommends nginx-light > /dev/null; }
    fi
    echo "$VLLM_ROUTER $SGLANG_ROUTER ${TOOLS[*]} nginx" > "$MARKER"
    echo "installed in $((SECONDS - started)) s" >&2
}

[ -f "$MARKER" ] || install
exec "$CACHE/tools/bin/python" scripts/bench_peers.py --cache "$CACHE" "$@"
