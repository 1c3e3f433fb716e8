"""Integration tests: real processes and servers on loopback (the launcher and torchrun, tiny
trainings, the initializer programs, HTTP/S3/Hub fakes, the fake API server, the CLI as a
program). The real control plane is the other tier: tests/cluster (make test-cluster)."""
