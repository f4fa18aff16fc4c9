"""The suite's own helpers, where a flaw in them fails some other, unrelated test."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

from tests.support.servers import free_port


def test_a_publisher_whose_bind_fails_leaves_no_context_to_hang_the_collector() -> None:
    """A context collected with its sockets open hangs in term(): the parallel run once lost
    120 s in an unrelated test's gc.collect()."""
    code = textwrap.dedent(
        """
        import gc, socket, zmq
        from tests.support import vllm_events as ve
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        kept = []  # as pytest keeps a failure: in a cycle the collector ends
        try:
            ve.Publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:%d" % taken.getsockname()[1],
                         legacy=False)
        except zmq.ZMQError as e:
            kept += [e, kept]
        del kept
        gc.collect()
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=20)


def test_free_ports_are_outside_the_range_outgoing_connections_take() -> None:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    for port in ports:
        assert 1024 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
