"""`dflash cluster` with two replicas of the embedded model in a local Ray: both serve, a
conversation's follow-up hits its replica's cache, and a conversation that moves restores from
the shared disk tier and gets the same greedy reply."""

from __future__ import annotations

from functools import partial

import httpx
import pytest
import trio

pytest.importorskip("ray.serve")

import ray  # noqa: E402

from dflash.cluster.app import deploy, serve_replicas, undeploy  # noqa: E402
from dflash.config import CacheConfig, ClusterConfig, Config, ModelConfig, ServerConfig  # noqa: E402

# Longer than a routing block (64 tokens), so a's replica records more prompt than b's.
QUESTION = ("I am planning a trip through Europe next spring and I am reading about the history, the food, "
            "the museums and the architecture of the big cities I might visit along the way, starting "
            "with the one I know least about. What is the capital of France?")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    config = Config(server=ServerConfig(port=0),
                    model=ModelConfig(dtype="float32", max_ctx=1024, threads=1, prefill_chunk=64),
                    cache=CacheConfig(disk_dir=str(tmp_path_factory.mktemp("shared-disk")), agent_turn_cache=True),
                    cluster=ClusterConfig(replicas=2, ray_actor_options={"num_cpus": 1}))
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="warning")
    from dflash.app import load_served_model

    handle = deploy(config, load_served_model)
    yield config, handle
    undeploy(config)


async def ask(client, session: str, messages: list[dict]) -> dict:
    response = await client.post("/v1/chat/completions", headers={"session_id": session},
                                 json={"messages": messages, "max_tokens": 12, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def disk_hits(status: dict) -> int:
    return sum(replica["cache_stats"]["tiers"].get("disk", {}).get("hits", 0) for replica in status["replicas"])


async def test_two_replicas_of_the_embedded_model(deployment, nursery):
    config, handle = deployment
    app = await nursery.start(partial(serve_replicas, config, handle, handle_signals=False))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.port}", timeout=120) as client:
        first = [{"role": "user", "content": QUESTION}]
        a = await ask(client, "a", first)
        b = await ask(client, "b", [{"role": "user", "content": "Name a primary colour."}])
        assert a["choices"][0]["message"]["content"] and b["choices"][0]["message"]["content"]
        status = (await client.get("/")).json()
        assert len(status["replicas"]) == 2
        assert all(replica["cache_stats"]["kv_tokens"] > 0 for replica in status["replicas"])  # both served

        follow_up = first + [a["choices"][0]["message"], {"role": "user", "content": "And of Italy?"}]
        again = await ask(client, "a", follow_up)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= a["usage"]["prompt_tokens"]

        # A new key is a new conversation to the router: between equally loaded replicas owning
        # one conversation each, it goes to the one that has seen fewer prompt blocks (b's),
        # whose memory has nothing of a's turns; the shared disk tier has them.
        before = disk_hits((await client.get("/")).json())
        await trio.sleep(1)  # the disk writer thread
        moved = await ask(client, "a-moved", follow_up)
        assert moved["usage"]["prompt_tokens_details"]["cached_tokens"] >= a["usage"]["prompt_tokens"]
        # Greedy: the same reply from the other replica, its prefix restored from disk.
        assert moved["choices"][0]["message"]["content"] == again["choices"][0]["message"]["content"]
        assert disk_hits((await client.get("/")).json()) == before + 1
    app.shutdown()
