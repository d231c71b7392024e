"""Replicas on a Ray cluster of several machines, shown with two Ray nodes on this one (Ray's own
multi-node cluster for tests): the front end joins the running cluster by its address
(`start_serve(address=...)`, what `vlora serve replicas.ray_address=...` does), one replica lands
on each node (each node offers one CPU, each replica asks for one), and clients get the single
engine's tokens through the RPyC front end from both machines."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve")

from adapter_cases import build_adapters  # noqa: E402

from serve import Engine, EngineConfig  # noqa: E402

TOKEN = "nodes-token-0123456789"


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)  # the second machine
    cluster.wait_for_nodes()
    try:
        yield cluster.address
    finally:
        cluster.shutdown()


def test_replicas_on_two_nodes_serve_through_one_front_end(two_nodes, vlora_home, tmp_path):
    import numpy as np
    from ray import serve
    from zoo import build_checkpoint

    from serve.distributed.replicas import ReplicatedEngine, build_deployment, start_serve, stop_serve
    from serve.engine import Request, SamplingParams
    from serve.rpc import Client, RpcServer

    ckpt = build_checkpoint("qwen2_vl_tiny", vlora_home / "zoo" / "qwen2_vl_tiny")
    # the checkpoint and adapter folders must be readable at the same path on every machine
    adapters = {k: str(v) for k, v in build_adapters(ckpt, tmp_path, ("qv8",)).items()}
    config = dict(device="cpu", dtype="float32", num_kv_blocks=96, adapter_slots=2, max_lora_rank=16)
    rng = np.random.default_rng(0)
    cases = [(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8), a) for a in ("qv8", None) * 4]
    local = Engine(ckpt, EngineConfig(**config, adapters=tuple(f"{n}={p}" for n, p in adapters.items())))
    want = [local.generate(Request(prompt="How many cars?", images=[img], adapter=a,
                                   sampling=SamplingParams(max_tokens=4, ignore_eos=True))).token_ids for img, a in cases]
    start_serve(address=two_nodes, env={"OMP_NUM_THREADS": "1", "VLORA_HOME": str(vlora_home)})
    try:
        # capacity 1: the router spills the second request at once to the other replica, on the other node
        handle = serve.run(build_deployment(str(ckpt), config, adapters, num_replicas=2,
                                            ray_actor_options={"num_cpus": 1}, max_ongoing_requests=1),
                           name="vlora", route_prefix=None)
        engine = ReplicatedEngine(handle)
        with RpcServer(engine, TOKEN, "127.0.0.1", 0) as server, Client("127.0.0.1", server.port, TOKEN) as client:
            streams = [client.submit_image("How many cars?", [img], adapter=a,
                                           sampling={"max_tokens": 4, "ignore_eos": True}) for img, a in cases]
            got = [s.result(180)["token_ids"] for s in streams]
        stats = engine.stats()
        engine.close()
    finally:
        stop_serve()
    assert got == want
    assert len(stats.by_node) == 2 and sum(stats.by_node.values()) == len(cases)  # both machines served
