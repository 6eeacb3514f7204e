"""Fixtures the broker tests share: `connect`, a factory of transports to the broker under test
(`broker_url`: Redis and ZeroMQ, tests/fixtures/services.py) that closes them all afterwards."""

import pytest

import broker


@pytest.fixture
def connect(broker_url):
    """Factory of transports to the broker under test; closes them all afterwards."""
    opened = []

    def make(**opts):
        transport = broker.connect(broker_url, **opts)
        opened.append(transport)
        return transport

    yield make
    for transport in opened:
        transport.close()
