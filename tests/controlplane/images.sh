#!/usr/bin/env bash
# `make images-local`: tunepack's three images (and the tier's Katib images) built on this machine, from a Debian base made here
# with debootstrap (no image registry is reachable), into the local container storage where the
# cluster tier's real node (imported into its containerd) and `podman run` find them under the
# names the runtimes use.
#
# Cached by content: the base is tagged by what it is made from (suite and packages) and made
# once; the images are built with buildah's layer cache, so a change to tunepack's source rebuilds
# only the wheel and the layers after it (the dependency layers stay). Superseded images are
# removed at the end and a failed build leaves no working container (--force-rm), so the storage
# holds one set (bounded).
#
# Needs root (debootstrap, buildah) and Debian's podman, buildah, runc and debootstrap: installed
# with apt-get when missing. Environment: SUITE (bookworm), MIRROR, REGISTRY (ghcr.io/tunepack),
# TUNEPACK_IMAGES_BUILD_SECONDS (1800): the build stops there, so CI on a fresh machine ends in
# time (a cold build took about 8 minutes on 2 cores); running it again reuses the finished layers.
set -euo pipefail
cd "$(dirname "$0")/../.."

SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
REGISTRY=${REGISTRY:-ghcr.io/tunepack}
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
# Python 3.11 is bookworm's own; venv for the images' virtual environment; `python` on PATH as in
# the public python image; CA certificates for https sources.
PACKAGES=python3,python3-venv,python-is-python3,ca-certificates
SCRATCH=${TMPDIR:-/var/tmp}/tunepack-images.$$

log() { printf '==> %s\n' "$*" >&2; }
budget=${TUNEPACK_IMAGES_BUILD_SECONDS:-1800}
deadline=$((SECONDS + budget))
bounded() {  # a build step, stopped when the budget is spent
    local left=$((deadline - SECONDS)) code=0
    if [ "$left" -gt 0 ]; then timeout --kill-after=20 "$left" "$@" || code=$?; else code=124; fi
    if [ "$code" -eq 124 ] || [ "$code" -eq 137 ]; then
        echo "images-local: stopped after the build budget of $budget s" \
            "(TUNEPACK_IMAGES_BUILD_SECONDS); run it again: finished layers are reused" >&2
    fi
    return "$code"
}
took() { printf '    %s: %d s\n' "$1" "$(($(date +%s) - $2))" >&2; }

if [ "$(id -u)" != 0 ]; then
    echo "images-local: needs root (debootstrap and buildah make root file systems)" >&2
    exit 2
fi
missing=()
for tool in podman buildah runc debootstrap; do
    command -v "$tool" >/dev/null || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]} (apt-get)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman buildah runc debootstrap >/dev/null
fi

trap 'rm -rf "$SCRATCH"' EXIT

# 1. The base: a minimal Debian root file system with python, imported as an image.
key=$(printf '%s\n' "$SUITE" "$PACKAGES" | sha256sum | cut -c1-12)
BASE=localhost/tunepack/base:$SUITE-$key
if podman image exists "$BASE"; then
    log "base $BASE (cached)"
else
    log "base $BASE: debootstrap $SUITE ($PACKAGES)"
    start=$(date +%s)
    mkdir -p "$SCRATCH"
    bounded debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$SCRATCH/rootfs" "$MIRROR" \
        >"$SCRATCH/debootstrap.log" 2>&1 || { tail -20 "$SCRATCH/debootstrap.log" >&2; exit 1; }
    rm -rf "$SCRATCH"/rootfs/var/cache/apt/archives/*.deb "$SCRATCH"/rootfs/var/lib/apt/lists/*
    tar -C "$SCRATCH/rootfs" --numeric-owner -c . | podman import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$BASE" >/dev/null
    rm -rf "$SCRATCH"
    took "base" "$start"
fi

# 2. The three images the runtimes run, under the names the runtimes use.
# A TLS-intercepting proxy's CA (this machine's pip trusts one): given to the builds' pip.
cert=()
if [ -n "${PIP_CERT:-}" ] && [ -f "$PIP_CERT" ]; then
    cert=(--volume "$PIP_CERT:/run/pip-cert.pem:ro" --build-arg PIP_CERT=/run/pip-cert.pem)
fi
build() {  # dockerfile target name
    local start
    start=$(date +%s)
    log "$REGISTRY/$3:$VERSION"
    bounded buildah bud --quiet --isolation chroot --layers --force-rm --network host \
        --ulimit nofile=4096:4096 --ulimit nproc=4096:4096 "${cert[@]}" \
        --build-arg PYTHON_IMAGE="$BASE" -f "$1" ${2:+--target "$2"} \
        -t "$REGISTRY/$3:$VERSION" . >/dev/null
    took "$3" "$start"
}
build initializers/Dockerfile dataset-initializer dataset-initializer
build initializers/Dockerfile model-initializer model-initializer
build trainers/Dockerfile "" trainer

# 3. Katib's programs that run in pods (tests/controlplane/katib.py), from the binaries build.sh
# cached (run first: make test-cluster's order), tagged as katib.images() names them.
KATIB_VERSION=$(sed -n 's/^KATIB_VERSION=//p' tests/controlplane/versions.env)
katib_bin=${TUNEPACK_CONTROLPLANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tunepack/controlplane}/katib@$KATIB_VERSION
if [ -f "$katib_bin/.complete" ]; then
    for target in suggestion-goptuna file-metrics-collector; do
        start=$(date +%s)
        log "localhost/tunepack/katib-$target:$KATIB_VERSION"
        bounded buildah bud --quiet --isolation chroot --layers --force-rm \
            --ulimit nofile=4096:4096 --ulimit nproc=4096:4096 --build-arg BASE="$BASE" \
            -f tests/controlplane/katib.Dockerfile --target "$target" \
            -t "localhost/tunepack/katib-$target:$KATIB_VERSION" "$katib_bin" >/dev/null
        took "katib-$target" "$start"
    done
else
    log "Katib's images not built: $katib_bin is missing (make controlplane first)"
fi

# 4. Bounded: images superseded by this build (untagged) and other bases go.
podman images --format '{{.Repository}}:{{.Tag}}' | grep '^localhost/tunepack/base:' \
    | grep -vx "$BASE" | xargs -r podman rmi >/dev/null || true
podman image prune -f >/dev/null
podman images --format '{{.Repository}}:{{.Tag}} {{.Size}}' \
    | grep -E "^($REGISTRY/|localhost/tunepack/)" >&2
