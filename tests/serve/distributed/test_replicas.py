"""Engine replicas on a local Ray cluster (loopback, CPU): two tiny replicas behind the RPyC front
end serve a mixed-adapter workload with the single engine's tokens, send an adapter's repeat
requests to the replica that holds it until that replica is full (then to the other, which loads
the adapter), and keep serving when one replica is killed (its requests are sent again and
answered)."""

from __future__ import annotations

import threading
import time

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from adapter_cases import build_adapters  # noqa: E402
from rpc_server import follower_pids  # noqa: E402
from serve_cases import case_specs, make_request  # noqa: E402

from serve import Engine, EngineConfig, SamplingParams  # noqa: E402

ADAPTERS = ("qv8", "all16", "mix")
TOKEN = "replica-token-0123456789"


@pytest.fixture(scope="module")
def cluster(vlora_home, tmp_path_factory):
    from zoo import build_checkpoint

    from serve.distributed.replicas import ReplicatedEngine, build_deployment, start_serve, stop_serve

    ckpt = build_checkpoint("qwen2_vl_tiny", vlora_home / "zoo" / "qwen2_vl_tiny")
    adapters = {k: str(v) for k, v in build_adapters(ckpt, tmp_path_factory.mktemp("replica_adapters"),
                                                     ADAPTERS).items()}
    config = dict(device="cpu", dtype="float32", num_kv_blocks=128, adapter_slots=4, max_lora_rank=16)
    served = {**adapters, **{f"solo-{n}": p for n, p in adapters.items()}}  # names no request used yet
    start_serve(num_cpus=2, env={"OMP_NUM_THREADS": "1", "VLORA_HOME": str(vlora_home)})
    handle = serve.run(build_deployment(str(ckpt), config, served, num_replicas=2), name="vlora",
                       route_prefix=None)
    try:
        yield ckpt, adapters, config, ReplicatedEngine(handle)
    finally:
        stop_serve()


def _requests(n: int, tokens: int = 4) -> list:
    specs = case_specs("qwen2_vl")
    out = []
    for i in range(n):
        r = make_request(specs[i % len(specs)], tokens, ignore_eos=True)
        r.sampling = SamplingParams(max_tokens=tokens, ignore_eos=True)
        r.adapter, r.request_id = (ADAPTERS + (None,))[i % 4], f"r{i}"
        out.append(r)
    return out


def _drive(engine, requests, timeout_s: float = 120.0) -> dict:
    for r in requests:
        engine.add_request(r)
    done, end = {}, time.monotonic() + timeout_s
    while engine.has_unfinished() and time.monotonic() < end:
        done.update({o.request_id: o for o in engine.step()})
    assert not engine.has_unfinished(), "requests left unanswered"
    return done


def test_replicas_behind_the_rpc_front_end_answer_like_one_engine(cluster):
    from serve.rpc import Client, RpcServer

    ckpt, adapters, config, engine = cluster
    local = Engine(ckpt, EngineConfig(**config, adapters=tuple(f"{n}={p}" for n, p in adapters.items())))
    requests = [r for r in _requests(12) if r.images]
    want = [o.token_ids for o in local.generate(requests)]
    with RpcServer(engine, TOKEN, "127.0.0.1", 0) as server, Client("127.0.0.1", server.port, TOKEN) as client:
        streams = [client.submit_image(r.prompt, r.images, adapter=r.adapter,
                                       sampling={"max_tokens": 4, "ignore_eos": True}) for r in requests]
        got = [s.result(120)["token_ids"] for s in streams]
    assert got == want and len(requests) >= 6
    assert len(engine.stats().by_replica) == 2  # both replicas served


def test_repeat_adapters_go_to_the_replica_that_holds_them(cluster):
    ckpt, adapters, config, engine = cluster

    # an adapter first seen alone is loaded by the replica that took it; once Ray's router knows
    # (replicas report their adapters), that adapter's later requests go there
    first = {}
    solos = tuple(f"solo-{n}" for n in ADAPTERS)
    for name in solos:
        r = _requests(1)[0]
        r.adapter, r.request_id = name, f"first-{name}"
        _drive(engine, [r])
        first[name] = engine.routes[r.request_id]
    time.sleep(3.0)
    repeats = []
    for name in solos:
        for i, r in enumerate(_requests(3)):
            r.adapter, r.request_id = name, f"again-{name}-{i}"
            repeats.append(r)
    _drive(engine, repeats)
    for r in repeats:
        assert engine.routes[r.request_id] == first[r.adapter], (r.request_id, first)


def test_a_full_replica_spills_its_adapter_to_the_other(cluster):
    from serve.distributed.replicas import ReplicatedEngine, build_deployment

    ckpt, adapters, config, _ = cluster
    capped = serve.run(build_deployment(str(ckpt), config, adapters, num_replicas=2, max_ongoing_requests=2),
                       name="capped", route_prefix=None)
    engine = ReplicatedEngine(capped)
    try:
        first = _requests(1)[0]
        first.adapter, first.request_id = "qv8", "capped-first"
        _drive(engine, [first])
        time.sleep(3.0)  # the router learns which replica holds qv8
        burst = _requests(8, tokens=128)
        for i, r in enumerate(burst):
            r.adapter, r.request_id = "qv8", f"capped-{i}"
        _drive(engine, burst)
        routes = [engine.routes[r.request_id] for r in burst]
        # the replica holding qv8 takes two at a time; the rest go to the other replica, which loads it
        assert routes.count(engine.routes[first.request_id]) < len(burst)
        assert set(routes) == set(engine.stats().by_replica) and len(set(routes)) == 2
    finally:
        engine.close()
        serve.delete("capped")


def test_adapters_loaded_at_start_outlive_the_multiplexing_limit(cluster):
    from serve.distributed.replicas import ReplicatedEngine, build_deployment

    ckpt, adapters, config, _ = cluster
    startup = {**config, "adapters": [f"{n}={p}" for n, p in adapters.items()]}  # as vlora serve's manifest
    handle = serve.run(build_deployment(str(ckpt), startup, {}, num_replicas=1, max_adapters_per_replica=1),
                       name="startup", route_prefix=None)
    engine = ReplicatedEngine(handle)
    try:
        for i, name in enumerate(ADAPTERS + ADAPTERS):  # each one pushes the one before out of Ray's LRU
            r = _requests(1)[0]
            r.adapter, r.request_id = name, f"startup-{i}"
            out = _drive(engine, [r])[r.request_id]
            assert out.finish_reason == "length", (name, out)
        assert {a["name"] for a in engine.list_adapters()} == set(ADAPTERS)
    finally:
        engine.close()
        serve.delete("startup")


def test_a_replica_leads_a_tensor_parallel_group_and_takes_it_down(cluster):
    from serve.distributed.replicas import ReplicatedEngine, build_deployment

    ckpt, adapters, config, _ = cluster
    local = Engine(ckpt, EngineConfig(**config, adapters=tuple(f"{n}={p}" for n, p in adapters.items())))
    requests = _requests(8)
    want = {o.request_id: o.token_ids for o in local.generate(requests)}
    before = follower_pids()
    handle = serve.run(build_deployment(str(ckpt), {**config, "tensor_parallel_size": 2}, adapters, num_replicas=1),
                       name="grouped", route_prefix=None)
    engine = ReplicatedEngine(handle)
    try:
        assert len(follower_pids() - before) == 1  # the replica started its rank 1
        got = {rid: o.token_ids for rid, o in _drive(engine, _requests(8)).items()}
        assert got == want
    finally:
        engine.close()
        serve.delete("grouped")
    end = time.monotonic() + 60
    while follower_pids() - before and time.monotonic() < end:
        time.sleep(0.5)
    assert not follower_pids() - before, "the replica's follower outlived it"


def test_a_killed_replica_loses_no_request(cluster):
    ckpt, adapters, config, engine = cluster
    requests = _requests(16, tokens=256)  # long enough to be in flight on both replicas when one dies
    for r in requests:
        # no adapter: Ray spreads them over both replicas by queue length, so the victim has some
        r.request_id, r.adapter = f"k-{r.request_id}", None
    names = [n for n in ray.util.list_named_actors(all_namespaces=True)
             if "SERVE_REPLICA" in str(n) and "vlora#" in str(n)]  # this app's, not a test's app going away
    assert len(names) == 2, names
    victim, errors = names[0], []

    def kill():
        try:
            ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=False)
        except Exception as e:  # reported below, not lost in the timer's thread
            errors.append(e)

    killer = threading.Timer(0.5, kill)
    killer.start()
    retried = engine.stats().retried
    got = _drive(engine, requests, timeout_s=180.0)
    killer.join()
    assert not errors, errors
    assert engine.stats().retried > retried  # the victim had requests in flight: they were sent again
    assert set(got) == {r.request_id for r in requests}
    assert all(o.finish_reason == "length" and len(o.token_ids) == 256 for o in got.values())


def test_a_control_store_that_never_starts_is_started_once_more(monkeypatch):
    """Ray's local start timing out is retried once in a new session; other failures, and a
    second time-out, reach the caller."""
    from serve.distributed import replicas

    calls, shutdowns = [], []
    monkeypatch.setattr(replicas.ray, "shutdown", lambda: shutdowns.append(1))

    def init(message):
        def fail(**kw):
            calls.append(kw)
            raise RuntimeError(message)
        return fail

    monkeypatch.setattr(replicas.ray, "init", init("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_y"))
    with pytest.raises(RuntimeError, match="Timed out waiting"):
        replicas.start_serve(num_cpus=1)
    assert len(calls) == 2 and len(shutdowns) == 1
    calls.clear()
    with pytest.raises(RuntimeError, match="Timed out waiting"):
        replicas.start_serve(address="10.0.0.1:6379")  # a cluster that is not there: no second try
    assert len(calls) == 1
    calls.clear()
    monkeypatch.setattr(replicas.ray, "init", init("something else"))
    with pytest.raises(RuntimeError, match="something else"):
        replicas.start_serve(num_cpus=1)
    assert len(calls) == 1
    calls.clear()

    def raylet_late(**kw):  # Ray's own words and type when its raylet misses the fixed 30 s
        calls.append(kw)
        if len(calls) == 1:
            raise Exception("The current node timed out during startup. This could happen because some of the "
                            "raylet failed to startup or the GCS has become overloaded.")

    monkeypatch.setattr(replicas.ray, "init", raylet_late)
    monkeypatch.setattr(replicas.serve, "start", lambda **kw: None)
    replicas.start_serve(num_cpus=1)  # started again, and up
    assert len(calls) == 2 and len(shutdowns) == 2
