#!/usr/bin/env bash
# Build the real control plane the cluster tier runs on, from published Go modules, and cache the
# binaries outside the checkout, one directory per component@version:
#   $TUNEPACK_CONTROLPLANE_CACHE/<component>@<version>/<binaries>
# A component whose directory is complete is not rebuilt, so a kept machine starts in seconds.
# Prints the cache directory on its last line. Needs only `go` and the Go module proxy.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
set -a  # exported: each build runs in a child bash
# shellcheck source=versions.env
. "$here/versions.env"
set +a
cache=${TUNEPACK_CONTROLPLANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tunepack/controlplane}
mkdir -p "$cache"
cache=$(cd "$cache" && pwd)
rm -rf "$cache"/.scratch.* "$cache"/.*@*.??????  # left by a build that was stopped
export CGO_ENABLED=0 GOFLAGS=-mod=mod GOTOOLCHAIN=local
# Go's module and build caches: the build's own, in $cache/.go, unless the caller names theirs
# (GOCACHE or GOMODCACHE). They let a build the budget stopped go on where it stopped, and are
# removed once every component is built: about 12 GB (measured) of sources and objects behind
# 0.9 GB of binaries, which a version bump would mostly not reuse.
own_go=""
if [ -z "${GOCACHE:-}" ] && [ -z "${GOMODCACHE:-}" ]; then
  own_go="$cache/.go"
  export GOCACHE="$own_go/build" GOMODCACHE="$own_go/mod"
fi
ldflags_base="-s -w"

log() { printf '[controlplane build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# done_or_build NAME VERSION FUNCTION BINARY...: runs FUNCTION with $out (a fresh staging
# directory) unless NAME@VERSION is complete and holds every BINARY (so a build that adds one is
# redone); the directory is renamed into place only when every binary is there.
done_or_build() {
  local name=$1 version=$2 fn=$3 dest="$cache/$1@$2" b missing=""
  shift 3
  kept+=("$name@$version")
  for b in "$@"; do [ -x "$dest/$b" ] || missing="$missing $b"; done
  if [ -f "$dest/.complete" ] && [ -z "$missing" ]; then log "$name@$version: cached"; return 0; fi
  local started=$SECONDS
  out=$(mktemp -d "$cache/.$name@$version.XXXXXX")
  chmod 755 "$out"
  local buildlog="$cache/$name@$version.build.log"
  log "$name@$version: building (go's output: $buildlog)"
  local left=$((deadline - SECONDS))
  if [ "$left" -le 0 ]; then
    log "$name@$version: not built: the build budget of $budget s is spent" \
      "(TUNEPACK_CONTROLPLANE_BUILD_SECONDS); run 'make controlplane' again to go on"
    rm -rf "$out"
    exit 1
  fi
  # A child bash (functions exported) under timeout, which stops go and its compilers with it;
  # errexit holds inside it, as it would not for a function called in `if`.
  export out
  local code=0
  timeout --kill-after=20 "$left" bash -euo pipefail -c "$fn" > "$buildlog" 2>&1 || code=$?
  if [ "$code" -ne 0 ]; then
    tail -n 40 "$buildlog" >&2
    if [ "$code" -eq 124 ] || [ "$code" -eq 137 ]; then
      log "$name@$version: build stopped after the budget of $budget s" \
        "(TUNEPACK_CONTROLPLANE_BUILD_SECONDS); run 'make controlplane' again: what was" \
        "downloaded and compiled so far is cached"
    else
      log "$name@$version: build FAILED (full output: $buildlog)"
    fi
    rm -rf "$out"
    exit 1
  fi
  for b in "$@"; do
    [ -x "$out/$b" ] || { log "$name@$version: build FAILED: it made no $b"; rm -rf "$out"; exit 1; }
  done
  date -u +%FT%TZ > "$out/.complete"
  rm -rf "$dest"; mv "$out" "$dest"
  log "$name@$version: built in $((SECONDS - started)) s"
}

# A scratch module in which $1 is a dependency; replaces derived from the dependency's go.mod.
scratch() {
  local dir; dir=$(mktemp -d "$cache/.scratch.XXXXXX")
  printf 'module tunepack.local/controlplane\n\ngo 1.26.0\n' > "$dir/go.mod"
  echo "$dir"
}

# `go install mod/cmd@version` would be shortest, but it asks the proxy for the module's version
# list (deprecation check), which the proxy may refuse; `go get` of the exact version in a scratch
# module builds the same dependency set (MVS over the module's own go.mod).
build_module() { # MODULE VERSION PACKAGE BINARY
  local dir; dir=$(scratch)
  (cd "$dir" && go get "$1@$2" && go build -o "$out/$4" -ldflags "$ldflags_base" "$3")
  rm -rf "$dir"
}

build_trainer() {
  build_module github.com/kubeflow/trainer/v2 "$TRAINER_VERSION" \
    github.com/kubeflow/trainer/v2/cmd/trainer-controller-manager trainer-controller-manager
}

build_jobset() {
  build_module sigs.k8s.io/jobset "$JOBSET_VERSION" sigs.k8s.io/jobset jobset
}

build_kwok() {
  build_module sigs.k8s.io/kwok "$KWOK_VERSION" sigs.k8s.io/kwok/cmd/kwok kwok
}

# etcd's server module replaces its sibling modules with ../paths, so `go install` refuses it:
# depend on it from a scratch module, with every go.etcd.io sibling at the same version.
build_etcd() {
  local dir; dir=$(scratch)
  (
    cd "$dir"
    local gomod; gomod=$(go mod download -json "go.etcd.io/etcd/server/v3@$ETCD_VERSION" \
      | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')
    sed -n 's#^[[:space:]]*\(go\.etcd\.io/etcd/[a-z0-9/]*\) => \.\./.*#\1#p' "$gomod" \
      | while read -r m; do echo "replace $m => $m $ETCD_VERSION" >> go.mod; done
    go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION"
    go build -o "$out/etcd" -ldflags "$ldflags_base" "go.etcd.io/etcd/server/v3"
  )
  rm -rf "$dir"
}

# k8s.io/kubernetes replaces its staging modules with ./staging paths: pin each to its published
# v0.x.y twin, keep its godebug line, and stamp the version so /version tells the truth.
# Kueue depends on k8s.io/kubernetes too (v1.36.0), so it is built here, in the same module and
# the same `go build` as the kube-* commands: every package they share compiles once (MVS takes
# the newer of each dependency). It is built against the Trainer API this tier runs (versions.env
# says why). scheduler-plugins cannot join: it pins Kubernetes 1.35 and does not compile against
# 1.36, and the module proxy serves no 1.36 release of it.
build_kubernetes() {
  local dir; dir=$(scratch)
  (
    cd "$dir"
    local gomod minor; gomod=$(go mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" \
      | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')
    minor="v0.${KUBERNETES_VERSION#v1.}"
    grep -m1 '^godebug' "$gomod" >> go.mod || true
    sed -n 's#^[[:space:]]*\(k8s\.io/[a-z0-9-]*\) => \./staging/.*#\1#p' "$gomod" \
      | while read -r m; do echo "replace $m => $m $minor" >> go.mod; done
    local pkgs="" c
    for c in $KUBERNETES_BINARIES; do pkgs="$pkgs k8s.io/kubernetes/cmd/$c"; done
    # shellcheck disable=SC2046,SC2086
    go get $(for p in $pkgs; do echo "$p@$KUBERNETES_VERSION"; done) \
      "sigs.k8s.io/kueue@$KUEUE_VERSION" "github.com/kubeflow/trainer/v2@$TRAINER_VERSION"
    local v="k8s.io/component-base/version" commit
    commit=$(go mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" \
      | sed -n 's/^[[:space:]]*"Hash": "\(.*\)",\{0,1\}$/\1/p' | head -1)
    local ld="$ldflags_base -X $v.gitVersion=$KUBERNETES_VERSION -X $v.gitCommit=${commit:-unknown}"
    ld="$ld -X $v.gitTreeState=clean -X $v.gitMajor=1 -X $v.gitMinor=$(echo "$KUBERNETES_VERSION" | cut -d. -f2)"
    ld="$ld -X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION"
    # shellcheck disable=SC2086
    go build -o "$out/" -ldflags "$ld" $pkgs sigs.k8s.io/kueue/cmd/kueue
  )
  rm -rf "$dir"
}

# scheduler-plugins pins its own Kubernetes (k8s.io/kubernetes and the staging modules it replaces
# with published versions): in a scratch module its replace directives do not apply, so copy them.
# Two binaries: the scheduler (kube-scheduler with the coscheduling plugin registered) and the
# controller that keeps PodGroup status (phase, scheduled and running counts).
build_scheduler_plugins() {
  local dir; dir=$(scratch)
  (
    cd "$dir"
    local gomod; gomod=$(go mod download -json "sigs.k8s.io/scheduler-plugins@$SCHEDULER_PLUGINS_VERSION" \
      | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')
    sed -n 's#^[[:space:]]*\(replace[[:space:]]\{1,\}\)\{0,1\}\([a-z0-9./-]*\) => \([a-z0-9./-]*\) \(v[^[:space:]]*\)$#replace \2 => \3 \4#p' \
      "$gomod" >> go.mod
    go get "sigs.k8s.io/scheduler-plugins@$SCHEDULER_PLUGINS_VERSION"
    go build -o "$out/kube-scheduler" -ldflags "$ldflags_base" sigs.k8s.io/scheduler-plugins/cmd/scheduler
    go build -o "$out/controller" -ldflags "$ldflags_base" sigs.k8s.io/scheduler-plugins/cmd/controller
  )
  rm -rf "$dir"
}

# The node's pod network: the standard CNI plugins (bridge, host-local IPAM, loopback).
build_cni() {
  local dir; dir=$(scratch) pkgs=""
  for p in main/bridge main/loopback ipam/host-local; do
    pkgs="$pkgs github.com/containernetworking/plugins/plugins/$p"
  done
  (
    cd "$dir"
    go get "github.com/containernetworking/plugins@$CNI_PLUGINS_VERSION"
    # shellcheck disable=SC2086
    go build -o "$out/" -ldflags "$ldflags_base" $pkgs
  )
  rm -rf "$dir"
}

# Cluster DNS: CoreDNS with only the plugins the tier's Corefile uses (coredns/main.go), as
# CoreDNS documents for a build of one's own, instead of its ~60 (cloud DNS clients included).
build_coredns() {
  local dir; dir=$(scratch)
  (
    cd "$dir"
    cp "$here/coredns/main.go" .
    go get "github.com/coredns/coredns@$COREDNS_VERSION"
    go build -o "$out/coredns" -ldflags "$ldflags_base -X github.com/coredns/coredns/coremain.GitCommit=$COREDNS_VERSION" .
  )
  rm -rf "$dir"
}

# Katib, built inside its own module (its go.mod, k8s.io 0.34): mixing it into the tier's 1.36
# module would build it against a Kubernetes it was not made for. Each main gets its own -o (the
# three .../v1beta1 mains would overwrite each other in one directory).
build_katib() {
  local dir
  dir=$(cd / && go mod download -json "github.com/kubeflow/katib@$KATIB_VERSION" \
    | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  cd "$dir"
  local m
  for m in katib-controller:cmd/katib-controller/v1beta1 katib-db-manager:cmd/db-manager/v1beta1 \
    suggestion-goptuna:cmd/suggestion/goptuna/v1beta1 \
    file-metricscollector:cmd/metricscollector/v1beta1/file-metricscollector; do
    GOFLAGS=-mod=readonly go build -o "$out/${m%%:*}" -ldflags "$ldflags_base" "./${m#*:}"
  done
}

# The node's sandbox process (pause/main.go, standard library only), cached by its content.
build_pause() {
  local dir; dir=$(scratch)
  (cd "$dir" && cp "$here/pause/main.go" . && go build -o "$out/pause" -ldflags "$ldflags_base" .)
  rm -rf "$dir"
}

# The files the tier reads from a component's module when it runs (CRDs, webhook and RBAC
# manifests, KWOK's stages), copied out of the module: the tier has no network and Go's caches
# are removed below. keep_files MODULE VERSION PATH...
keep_files() {
  local dir p
  dir=$(cd / && go mod download -json "$1@$2" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  shift 2
  for p in "$@"; do mkdir -p "$out/$(dirname "$p")" && cp -R "$dir/$p" "$out/$p"; done
  chmod -R u+w,a+rX "$out"  # the module cache's copies are read-only
}

command -v go >/dev/null || { echo "build.sh: go is not on PATH (the cluster tier needs Go 1.26)" >&2; exit 2; }
# A bound on the cold build, so CI on a fresh machine ends in time even with a slow proxy: about
# 19 minutes on a busy 2-core machine when measured, 35 allowed. Go's caches keep what a stopped
# build did.
budget=${TUNEPACK_CONTROLPLANE_BUILD_SECONDS:-2100}
deadline=$((SECONDS + budget))
export ldflags_base cache here
export -f keep_files scratch build_module build_cni build_coredns build_pause build_trainer build_jobset build_kwok build_etcd build_kubernetes \
  build_scheduler_plugins build_katib
total=$SECONDS
kept=()
# shellcheck disable=SC2086
done_or_build kubernetes "$KUBERNETES_VERSION+kueue-$KUEUE_VERSION+trainer-$TRAINER_VERSION" \
  build_kubernetes $KUBERNETES_BINARIES kueue
done_or_build etcd "$ETCD_VERSION" build_etcd etcd
done_or_build trainer "$TRAINER_VERSION" build_trainer trainer-controller-manager
done_or_build jobset "$JOBSET_VERSION" build_jobset jobset
done_or_build kwok "$KWOK_VERSION" build_kwok kwok
done_or_build scheduler-plugins "$SCHEDULER_PLUGINS_VERSION" build_scheduler_plugins kube-scheduler controller
done_or_build cni-plugins "$CNI_PLUGINS_VERSION" build_cni bridge loopback host-local
done_or_build coredns "$COREDNS_VERSION" build_coredns coredns
# shellcheck disable=SC2086
done_or_build katib "$KATIB_VERSION" build_katib $KATIB_BINARIES
done_or_build pause "$(sha256sum "$here/pause/main.go" | cut -c1-12)" build_pause pause
files() { # NAME MODULE VERSION PATH...: the module's PATHs in NAME-files@VERSION
  local name=$1 module=$2 version=$3
  shift 3
  done_or_build "$name-files" "$version" "keep_files $module $version $*" "$@"
}
files trainer github.com/kubeflow/trainer/v2 "$TRAINER_VERSION" manifests/base
files jobset sigs.k8s.io/jobset "$JOBSET_VERSION" config/components
files kwok sigs.k8s.io/kwok "$KWOK_VERSION" kustomize/stage
files scheduler-plugins sigs.k8s.io/scheduler-plugins "$SCHEDULER_PLUGINS_VERSION" config/crd
files kueue sigs.k8s.io/kueue "$KUEUE_VERSION" config/components/crd config/components/webhook
files katib github.com/kubeflow/katib "$KATIB_VERSION" manifests/v1beta1/components/crd \
  manifests/v1beta1/components/webhook manifests/v1beta1/components/controller
# Bounded: what an earlier version of this script built and this one no longer names goes.
for entry in "$cache"/*@*; do
  [ -d "$entry" ] || continue
  case " ${kept[*]} " in *" $(basename "$entry") "*) ;; *)
    log "removing $(basename "$entry") (superseded)"; rm -rf "$entry" "$entry.build.log" ;;
  esac
done
if [ -n "$own_go" ] && [ -d "$own_go" ]; then
  log "removing Go's caches of this build ($(du -sh "$own_go" | cut -f1)): every component is built"
  go clean -modcache  # the module cache is read-only; go makes it writable as it removes it
  rm -rf "$own_go"
fi
log "all components ready in $((SECONDS - total)) s"
echo "$cache"
