#!/usr/bin/env bash
# Entrypoint of the infemeral-server image (docker/Dockerfile).
#
#   entrypoint.sh [SERVER FLAGS...]    check the configuration, then exec infemeral-server FLAGS
#   entrypoint.sh healthcheck [ARGS]   ask the local server's gRPC health service (exit 0: SERVING)
#   entrypoint.sh gpu-check [ARGS]     prove the GPU path: FlashInfer, bfloat16 serving, throughput
#   entrypoint.sh COMMAND [ARGS...]    run any other command as is (bash, infemeral-client, ...)
#
# Defaults: INFEMERAL_BUNDLE=/bundle, INFEMERAL_STORE=/store, INFEMERAL_LISTEN=0.0.0.0:50051.
# Flags given to the container override the INFEMERAL_* variables, as they do for the server.
# The server replaces this shell (exec), so `docker stop`'s SIGTERM reaches it directly and
# it shuts down gracefully.
set -euo pipefail

here=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd)

fail() {
    # One message, one line per argument, then exit 2 (a configuration error).
    printf 'infemeral-entrypoint: %s\n' "$1" >&2
    shift
    if (($#)); then printf '  %s\n' "$@" >&2; fi
    exit 2
}

warn() { printf 'infemeral-entrypoint: warning: %s\n' "$*" >&2; }

is_true() {
    # The spellings of "true" that the server's settings (pydantic) accept.
    case "${1,,}" in
        1 | true | t | yes | y | on) return 0 ;;
        *) return 1 ;;
    esac
}

case "${1:-}" in
    healthcheck)
        shift
        exec python3 "$here/healthcheck.py" "$@"
        ;;
    gpu-check)
        shift
        exec python3 "$here/gpu_check.py" "$@"
        ;;
    infemeral-server) shift ;;
    "" | -*) ;;
    *) exec "$@" ;;
esac

for arg in "$@"; do
    if [[ $arg == -h || $arg == --help ]]; then exec infemeral-server "$@"; fi
done

: "${INFEMERAL_BUNDLE:=/bundle}"
: "${INFEMERAL_STORE:=/store}"
: "${INFEMERAL_LISTEN:=0.0.0.0:50051}"
export INFEMERAL_BUNDLE INFEMERAL_STORE INFEMERAL_LISTEN

# A user without a writable home (`docker run --user 1234`) still needs a cache directory.
if [[ ! -w ${HOME:-/nonexistent} ]]; then export HOME=${TMPDIR:-/tmp}; fi

# FlashInfer compiles its CUDA kernels on first use and keeps them under
# $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer: on a volume, they are compiled only once.
if [[ -n ${FLASHINFER_WORKSPACE_BASE:-} ]]; then
    mkdir -p "$FLASHINFER_WORKSPACE_BASE" 2>/dev/null || true
    if [[ ! -w $FLASHINFER_WORKSPACE_BASE ]]; then
        warn "FLASHINFER_WORKSPACE_BASE=$FLASHINFER_WORKSPACE_BASE is not writable by uid $(id -u);" \
            "attention kernels will be compiled into $HOME on every start instead."
        export FLASHINFER_WORKSPACE_BASE=$HOME
    fi
fi

# The settings the server will use: variables, overridden by flags.
bundle=$INFEMERAL_BUNDLE
store=$INFEMERAL_STORE
listen=$INFEMERAL_LISTEN
tls_cert=${INFEMERAL_TLS_CERT:-}
tls_key=${INFEMERAL_TLS_KEY:-}
tls_client_ca=${INFEMERAL_TLS_CLIENT_CA:-}
allow_plaintext=${INFEMERAL_ALLOW_PLAINTEXT:-false}
api_keys=${INFEMERAL_API_KEYS:-}${INFEMERAL_API_KEYS_FILE:-}

set_setting() {
    case "$1" in
        bundle) bundle=$2 ;;
        store) store=$2 ;;
        listen) listen=$2 ;;
        tls-cert) tls_cert=$2 ;;
        tls-key) tls_key=$2 ;;
        tls-client-ca) tls_client_ca=$2 ;;
        api-keys | api-keys-file) api_keys+=$2 ;;
    esac
}

args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    arg=${args[i]}
    case "$arg" in
        --bundle | --store | --listen | --tls-cert | --tls-key | --tls-client-ca | --api-keys | --api-keys-file)
            ((i + 1 < ${#args[@]})) || fail "$arg needs a value"
            set_setting "${arg#--}" "${args[i + 1]}"
            i=$((i + 1))
            ;;
        --bundle=* | --store=* | --listen=* | --tls-cert=* | --tls-key=* | --tls-client-ca=* | --api-keys=* | --api-keys-file=*)
            name=${arg%%=*}
            set_setting "${name#--}" "${arg#*=}"
            ;;
        --allow-plaintext) allow_plaintext=true ;;
        --no-allow-plaintext) allow_plaintext=false ;;
    esac
done

# --- the server bundle -------------------------------------------------------------------
if [[ ! -d $bundle ]]; then
    fail "no server bundle at $bundle (it must contain manifest.json)." \
        "Mount the server/ directory that \`infemeral-client prepare\` wrote, read-only:" \
        "  docker run ... -v \$HOME/bundles/MODEL/server:/bundle:ro ..." \
        "or point INFEMERAL_BUNDLE (or --bundle) at it (RunPod: /workspace/infemeral/server)."
fi
if [[ ! -e $bundle/manifest.json ]]; then
    hint="Mount the server/ directory that \`infemeral-client prepare\` wrote (not its parent)."
    if [[ -e $bundle/server/manifest.json ]]; then
        hint="It has a server/ subdirectory: set INFEMERAL_BUNDLE=$bundle/server, or mount that one."
    fi
    fail "$bundle is not a server bundle: it has no manifest.json." "$hint"
fi
if [[ ! -r $bundle/manifest.json ]]; then
    fail "cannot read $bundle/manifest.json as uid $(id -u)." \
        "\`infemeral-client prepare\` writes bundles owner-only (0600): run the container as their owner" \
        "(docker run --user \"\$(id -u):\$(id -g)\", or INFEMERAL_UID/INFEMERAL_GID with docker/compose.yaml)."
fi
if grep -q '"infemeral-client-bundle"' "$bundle/manifest.json" || [[ -e $bundle/basis.safetensors ]]; then
    fail "$bundle is a CLIENT bundle: it holds your secret basis and must never leave your laptop." \
        "Mount the server/ directory of the bundle instead, and delete this copy from the machine."
fi

# --- the session store (a directory, or Redis) -------------------------------------------
case "$store" in
    redis://* | rediss://* | unix://*) ;;
    *)
        dir=${store#file://}
        if [[ -e $dir && ! -d $dir ]]; then
            fail "session store $dir exists and is not a directory."
        fi
        if [[ -d $dir && ! -w $dir ]]; then
            fail "session store $dir is not writable by uid $(id -u)." \
                "Give the volume to the server's user (chown -R $(id -u):$(id -g) on it)," \
                "or use Redis: INFEMERAL_STORE=redis://HOST:6379/0."
        fi
        ;;
esac

# --- TLS, and plaintext only where it is safe --------------------------------------------
if [[ -n $tls_cert && -z $tls_key ]] || [[ -z $tls_cert && -n $tls_key ]]; then
    fail "set both INFEMERAL_TLS_CERT and INFEMERAL_TLS_KEY (PEM files), or neither."
fi
if [[ -n $tls_client_ca && -z $tls_cert ]]; then
    fail "INFEMERAL_TLS_CLIENT_CA (mutual TLS) needs INFEMERAL_TLS_CERT and INFEMERAL_TLS_KEY too."
fi
for pem in "$tls_cert" "$tls_key" "$tls_client_ca"; do
    if [[ -n $pem && ! -r $pem ]]; then
        fail "cannot read $pem as uid $(id -u) (a TLS file set in INFEMERAL_TLS_*)." \
            "Key files are owner-only: run the container as their owner (docker run --user," \
            "INFEMERAL_UID/INFEMERAL_GID with docker/compose.yaml), or give them to uid $(id -u)."
    fi
done

host=${listen%:*}
host=${host#[}
host=${host%]}
loopback=false
case "$host" in
    localhost | 127.* | ::1) loopback=true ;;
esac
case "$listen" in unix:*) loopback=true ;; esac

if [[ -z $tls_cert && $loopback == false ]]; then
    if ! is_true "$allow_plaintext"; then
        fail "refusing to serve plaintext gRPC on $listen." \
            "Without TLS the session keys and API keys that clients send, and the hidden states," \
            "cross the network in the clear, and anyone on the path can read or replace them." \
            "Set INFEMERAL_TLS_CERT and INFEMERAL_TLS_KEY (see README, \"Deploying on RunPod\")," \
            "or INFEMERAL_ALLOW_PLAINTEXT=true if a TLS-terminating proxy or tunnel that you" \
            "control is the only way in, or listen on 127.0.0.1."
    fi
    warn "serving PLAINTEXT gRPC on $listen (INFEMERAL_ALLOW_PLAINTEXT): keep it behind TLS you control."
fi
if [[ $loopback == false && -z $api_keys && -z $tls_client_ca ]]; then
    warn "no INFEMERAL_API_KEYS(_FILE) and no client certificates: anyone who reaches $listen can use this GPU."
fi

exec infemeral-server "$@"
