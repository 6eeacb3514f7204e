"""Fixtures of the learner tests: `publish` puts a scored group (tests/unit/learner/groups.py) on the
scored stream of the test's Redis."""

import pytest

import broker
from broker.channel import Publisher
from broker.images import ImageStore
from tests.unit.learner.groups import make_group


@pytest.fixture
def publish(redis_server, names, tiny_processor):
    transport = broker.connect(redis_server.url)
    pub = Publisher(transport, names.scored)
    store = ImageStore(transport, names)

    def send(rewards, mutate=None, **kw):
        group = make_group(tiny_processor, store, rewards, **kw)
        if mutate is not None:
            mutate(group)
        pub.publish(group)
        return group

    yield send
    transport.close()
