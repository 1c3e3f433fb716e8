# Katib's Go programs that run in pods (tests/controlplane/katib.py), on tunepack's Debian base,
# from the binaries build.sh caches (the build context), as non-root like Katib's own images.
ARG BASE
FROM ${BASE} AS suggestion-goptuna
COPY suggestion-goptuna /usr/local/bin/suggestion-goptuna
USER 1000
ENTRYPOINT ["/usr/local/bin/suggestion-goptuna"]

# The StdOut/File metrics collector: a sidecar the webhook adds to each trial's primary pod.
FROM ${BASE} AS file-metrics-collector
COPY file-metricscollector /usr/local/bin/file-metricscollector
USER 1000
ENTRYPOINT ["/usr/local/bin/file-metricscollector"]
