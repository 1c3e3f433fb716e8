"""The cluster tier's server ports (tests/controlplane/cluster.py), on loopback."""

import itertools
import socket
from pathlib import Path

from tests.controlplane.cluster import server_ports


def test_server_ports_are_distinct_free_and_below_the_ephemeral_range():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = server_ports()
    with socket.socket() as taken:  # a port something already listens on is skipped
        first = next(ports)
        taken.bind(("127.0.0.1", first + 1))
        taken.listen()
        rest = list(itertools.islice(ports, 40))
    assert first + 1 not in rest
    given = [first, *rest]
    assert len(set(given)) == len(given) == 41
    assert all(12000 <= p < low for p in given), given
