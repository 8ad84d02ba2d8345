"""What a node hands out for its sockets when it binds every interface (shared/host_address.py)."""

from __future__ import annotations

import pytest

from shared.host_address import address_host, advertised_ip, is_loopback, is_wildcard, route_source_ip


def test_a_configured_address_wins_over_everything() -> None:
    assert advertised_ip("0.0.0.0", " 10.0.0.7 ", "tcp://scheduler.invalid:7200") == "10.0.0.7"


def test_a_specific_bind_address_is_the_address_handed_out() -> None:
    assert advertised_ip("127.0.0.1", "", "tcp://scheduler.invalid:7200") == "127.0.0.1"


def test_a_wildcard_bind_hands_out_the_route_source_toward_the_scheduler() -> None:
    assert is_wildcard("0.0.0.0") and is_wildcard("::") and is_wildcard("*") and not is_wildcard("10.1.2.3")
    assert advertised_ip("0.0.0.0", "", "tcp://127.0.0.1:7200") == "127.0.0.1"
    assert route_source_ip("tcp://localhost:7200") in ("127.0.0.1", "::1")


def test_an_address_that_is_not_tcp_host_port_is_refused() -> None:
    assert address_host("tcp://scheduler.internal:7200") == ("scheduler.internal", 7200)
    for bad in ("ipc:///tmp/x", "tcp://host", "scheduler:7200"):
        with pytest.raises(ValueError):
            address_host(bad)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.4.5", True),
        ("::1", True),
        ("[::1]", True),
        ("::ffff:127.0.0.1", True),
        ("localhost", True),
        ("10.0.0.5", False),
        ("0.0.0.0", False),
        ("fe80::1%eth0", False),
        ("example.org", False),
        ("", False),
    ],
)
def test_only_this_machine_s_loopback_counts_as_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
