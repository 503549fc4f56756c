"""The tests' port picker: several ports asked for at once are distinct (the kernel's probe may repeat one),
and none is an ephemeral port an outgoing connection could take before the server binds it."""

from __future__ import annotations

import conftest


class RepeatingSocket:
    """A socket whose bind to port 0 gets the ports listed, in order, as a kernel may."""

    ports = iter([])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def bind(self, address):
        self.port = next(RepeatingSocket.ports)

    def getsockname(self):
        return ("127.0.0.1", self.port)


def test_a_port_the_kernel_offers_twice_is_handed_out_once(monkeypatch):
    monkeypatch.setattr(conftest, "_HANDED_OUT", set(), raising=False)
    monkeypatch.setattr(conftest.socket, "socket", RepeatingSocket)
    RepeatingSocket.ports = iter([57679, 57679, 57679, 40145])
    assert [conftest.free_port(), conftest.free_port()] == [57679, 40145]


def test_ports_come_from_below_the_ephemeral_range_and_above_rays_worker_ports(monkeypatch):
    monkeypatch.setattr(conftest, "_HANDED_OUT", set(), raising=False)
    ephemeral = conftest.ephemeral_ports()
    ports = [conftest.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(conftest.PORTS_FROM <= p < ephemeral.start for p in ports), (ports, ephemeral)
