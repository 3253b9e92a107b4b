"""A local Ray (2 CPUs, no dashboard) with two fake-engine replicas, shared by a test module and
shut down after it: starting Ray and Serve takes most of the time these tests take."""

from __future__ import annotations

import attrs
import pytest
import trio

pytest.importorskip("ray.serve")

import ray  # noqa: E402

from dflash.cluster.app import deploy, undeploy  # noqa: E402
from dflash.cluster.front import ClusterScheduler  # noqa: E402
from dflash.config import ClusterConfig, Config, ServerConfig  # noqa: E402
from tests.unit.fakes import FakeEngine, fake_loader  # noqa: E402

# Replicas take no CPU reservation: a killed one's replacement must not wait for a free core.
FAKE_CLUSTER = ClusterConfig(replicas=2, ray_actor_options={"num_cpus": 0}, imbalance_threshold=1)


@attrs.frozen
class Deployment:
    config: Config
    handle: object


def start_deployment(config: Config, loader) -> Deployment:
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="warning")
    return Deployment(config, deploy(config, loader))


@pytest.fixture(scope="module")
def fake_deployment():
    """Endless replies (they end at max_tokens), 10 ms a token."""
    config = Config(server=ServerConfig(port=0, queue_max=4), cluster=FAKE_CLUSTER)
    deployment = start_deployment(config, fake_loader(FakeEngine(endless=True, decode_step_s=0.01)))
    yield deployment
    undeploy(config)


@pytest.fixture
async def front(fake_deployment, nursery):
    scheduler = ClusterScheduler(fake_deployment.handle, fake_deployment.config.cluster.replicas,
                                 queue_max=fake_deployment.config.server.queue_max)
    nursery.start_soon(scheduler.run)
    await trio.sleep(0)
    return scheduler
