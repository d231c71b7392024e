"""The unified adapter pool: LRU slots and host cache, pinning, rank mixes in one slot, loading and
unloading while requests run, start-up loading (list and fusion manifest), and adapter directories
that must be refused with a clear error while everything else goes on unchanged."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from adapter_cases import make_adapter, make_head
from adapter_cases import one_thread  # noqa: F401 (autouse: one intra-op thread here)

from serve import Engine, EngineConfig, Request, SamplingParams
from serve.engine import AdapterGate, BlockManager, Scheduler, SchedulerConfig, Sequence
from serve.lora import AdapterLoadError

NAME = "qwen2_vl_tiny"
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (modules, rank, alpha)
SPECS = {"a": (["q_proj", "v_proj"], 8, 16), "b": (ALL, 16, 32), "c": (["o_proj", "down_proj"], 4, 4),
         "d": (["q_proj", "gate_proj"], 16, 8)}


@pytest.fixture(scope="module")
def adapters(tiny_zoo, tmp_path_factory):
    from zoo import load_pretrained

    root = tmp_path_factory.mktemp("pool_adapters")
    model = load_pretrained(tiny_zoo[NAME])[0]
    out = {n: make_adapter(model, root / n, m, r, alpha, seed=i + 3)
           for i, (n, (m, r, alpha)) in enumerate(SPECS.items())}
    out["root"] = root
    return out


def _engine(tiny_zoo, adapters, names=("a", "b", "c"), **config) -> Engine:
    engine = Engine(tiny_zoo[NAME], EngineConfig(device="cpu", num_kv_blocks=64, **config))
    for n in names:
        engine.load_adapter(n, adapters[n])
    return engine


def _request(i: int, adapter: str | None, n: int = 8, max_new: int = 4) -> Request:
    ids = [(37 * i + 11 * t) % 1900 + 20 for t in range(n)]
    return Request(prompt_token_ids=ids, adapter=adapter, sampling=SamplingParams(max_tokens=max_new, keep_logits=True))


def _slot_rows(pool, kind, slot):
    return pool.lora_a[kind][:, :, slot], pool.lora_b[kind][:, slot], pool.ranks[kind][:, :, slot]


def test_slots_and_host_cache_evict_the_least_recently_used(tiny_zoo, adapters):
    engine = _engine(tiny_zoo, adapters, adapter_slots=2, host_adapter_cache=2)
    m = engine.lora
    assert m.host.names() == ["b", "c"] and m.counters["host_reads"] == 3  # "a" fell out of the host cache
    assert m.ready("a") and m.counters["host_reads"] == 4  # read again from its directory
    assert m.ready("b") and m.slots == ["a", "b"]
    assert m.ready("c") and m.slots == ["c", "b"]  # "a" was the least recently used
    m.acquire("c")
    assert m.ready("a") and m.slots == ["c", "a"]  # "c" is held by a running sequence: "b" goes
    assert m.ready("b") and m.slots == ["c", "b"]
    m.release("c")
    assert engine.stats().adapter_slot_evictions == 3 and engine.stats().adapter_swaps == 5
    # the slot holds exactly the adapter's packed weights (rank 8 on q and v, nothing on k)
    weights, _ = m._read(adapters["a"])
    m.ready("a")
    a, b, ranks = _slot_rows(m.pool, "qkv_proj", m.slots.index("a"))
    assert torch.equal(ranks, weights.ranks["qkv_proj"]) and ranks[:, 1].eq(0).all() and ranks[:, 0].eq(8).all()
    assert torch.equal(a[:, :, :16], weights.lora_a["qkv_proj"]) and a[:, :, 16:].eq(0).all()
    assert torch.equal(b[:, :, :16], weights.lora_b["qkv_proj"])
    assert _slot_rows(m.pool, "down_proj", m.slots.index("a"))[2].eq(0).all()


def test_a_pinned_adapter_keeps_its_slot(tiny_zoo, adapters):
    engine = _engine(tiny_zoo, adapters, names=("a", "b", "c", "d"), adapter_slots=2)
    engine.pin_adapter("a")
    m = engine.lora
    for name in ("b", "c", "d", "b", "c"):
        assert m.ready(name) and "a" in m.slots
    with pytest.raises(ValueError, match="must stay unpinned"):
        engine.pin_adapter("b")
    info = {a["name"]: a for a in engine.list_adapters()}
    assert info["a"]["pinned"] and info["a"]["resident"] and not info["b"]["pinned"]
    engine.pin_adapter("a", False)
    assert m.ready("d") and m.ready("b") and "a" not in m.slots
    # pinned adapters serve as usual
    out = engine.generate([_request(0, "a"), _request(1, "b")])
    assert all(o.finish_reason == "length" for o in out)


def test_a_slot_reused_by_a_lower_rank_adapter_keeps_no_stale_rows(tiny_zoo, adapters):
    engine = _engine(tiny_zoo, adapters, adapter_slots=1)
    m = engine.lora
    assert m.ready("b")  # rank 16 on all seven projections
    assert m.ready("c") and m.slots == ["c"]  # rank 4 on o and down only, into the same slot
    for kind, rank in (("qkv_proj", 0), ("gate_up_proj", 0), ("o_proj", 4), ("down_proj", 4)):
        a, b, ranks = _slot_rows(m.pool, kind, 0)
        assert ranks.eq(rank).all()
        assert a[:, :, rank:].eq(0).all() and b[:, :, rank:].eq(0).all()
        assert rank == 0 or a[:, :, :rank].abs().sum() > 0
    assert m.pool.scales["o_proj"][0] == 1.0 and m.pool.scales["qkv_proj"][0] == 0.0  # alpha 4 / rank 4


def test_loading_and_unloading_while_requests_run(tiny_zoo, adapters):
    alone = _engine(tiny_zoo, adapters, names=("a", "d"), adapter_slots=2)
    expected = [o.token_ids for o in alone.generate([_request(0, "a"), _request(1, None), _request(2, "d")])]
    engine = _engine(tiny_zoo, adapters, names=("a", "c"), adapter_slots=2)
    first = [engine.add_request(_request(0, "a")), engine.add_request(_request(1, None))]
    final = {}
    final.update({o.request_id: o for o in engine.step() if o.finished})
    engine.load_adapter("d", adapters["d"])  # while "a" runs
    third = engine.add_request(_request(2, "d"))
    engine.unload_adapter("c")  # unused: goes at once
    with pytest.raises(ValueError, match="in flight"):
        engine.unload_adapter("a")
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    assert [final[i].token_ids for i in first + [third]] == expected
    engine.unload_adapter("a")
    assert sorted(a["name"] for a in engine.list_adapters()) == ["d"]
    with pytest.raises(ValueError, match="adapter 'a' is not loaded"):
        engine.add_request(_request(0, "a"))
    # an in-flight request can be aborted by the unload when asked
    rid = engine.add_request(_request(3, "d", max_new=50))
    engine.step()
    engine.unload_adapter("d", abort=True)
    out = engine.step()
    assert [(o.request_id, o.finish_reason) for o in out] == [(rid, "abort")]
    assert engine.stats().blocks_in_use == 0 and engine.lora.slots == [None, None]


def test_a_reloaded_adapter_never_reuses_the_old_ones_cached_prefix(tiny_zoo, adapters):
    long = dict(n=40, max_new=3)  # two full 16-token blocks enter the prefix cache
    engine = _engine(tiny_zoo, adapters, names=("a",), adapter_slots=2)
    engine.generate(_request(5, "a", **long))
    engine.unload_adapter("a")
    engine.load_adapter("a", adapters["b"])  # the same name, other weights
    again = engine.generate(_request(5, "a", **long))
    assert again.metrics.num_cached_tokens == 0
    fresh = Engine(tiny_zoo[NAME], EngineConfig(device="cpu", num_kv_blocks=64, adapter_slots=1))
    fresh.load_adapter("a", adapters["b"])
    assert again.token_ids == fresh.generate(_request(5, "a", **long)).token_ids
    repeat = engine.generate(_request(5, "a", **long))  # the same adapter version does share
    assert repeat.metrics.num_cached_tokens == 32 and repeat.token_ids == again.token_ids


def test_adapters_load_at_start_from_a_list_and_a_fusion_manifest(tiny_zoo, adapters, tmp_path):
    manifest = {"adapters": [{"name": "fused_0", "path": str(adapters["a"]), "index": 0, "domains": ["signs"],
                              "accuracies": {"signs": 0.9}, "met": True}],
                "tasks": {"signs": {"adapter": "fused_0", "head": "signs", "task": "classify", "accuracy": 0.9,
                                    "requirement": 0.8, "met": True}},
                "order": ["signs"], "created_by": "vlora fusion"}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    config = EngineConfig(device="cpu", num_kv_blocks=32, adapter_slots=2, adapter_manifest=str(tmp_path),
                          adapters=(str(adapters["c"]), f"wide={adapters['b']}"), pinned_adapters=("c",))
    engine = Engine(tiny_zoo[NAME], config)
    info = {a["name"]: a for a in engine.list_adapters()}
    assert sorted(info) == ["c", "fused_0", "wide"]
    assert info["wide"]["rank"] == 16 and info["wide"]["targets"] == ALL and info["wide"]["ranks"]["down_proj"] == 16
    assert info["c"]["pinned"] and info["c"]["resident"] and info["c"]["targets"] == ["o_proj", "down_proj"]
    assert info["fused_0"]["ranks"] == {"q_proj": 8, "v_proj": 8} and info["fused_0"]["heads"] == {}
    json.dumps(engine.list_adapters())  # what the RPC service sends


def _corruptions(adapters, tiny_zoo, root):
    """(directory, what the error must say) for directories the server must refuse."""
    good = adapters["a"]

    def copy(name):
        path = root / name
        shutil.copytree(good, path)
        return path

    bad = []
    bad.append((root / "missing", "does not exist"))
    p = copy("no_config")
    (p / "adapter_config.json").unlink()
    bad.append((p, "no adapter_config.json"))
    p = copy("bad_json")
    (p / "adapter_config.json").write_text("{not json")
    bad.append((p, "not valid JSON"))
    p = copy("truncated")
    data = (p / "adapter_model.safetensors").read_bytes()
    (p / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    bad.append((p, "cannot be read"))
    p = copy("dora")
    config = json.loads((p / "adapter_config.json").read_text())
    (p / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    bad.append((p, "unsupported LoRA options"))
    p = copy("nan")
    from safetensors.torch import load_file, save_file

    tensors = load_file(p / "adapter_model.safetensors")
    next(t for k, t in tensors.items() if "lora_B" in k)[0, 0] = float("nan")
    save_file(tensors, p / "adapter_model.safetensors")
    bad.append((p, "not finite"))
    from zoo import load_pretrained

    qwen = load_pretrained(tiny_zoo[NAME])[0]
    from peft import LoraConfig, get_peft_model

    merger = get_peft_model(qwen, LoraConfig(r=4, target_modules=r".*visual.*merger\.mlp\.0"))  # the tower is served
    merger.save_pretrained(str(root / "merger"))
    merger.unload()
    bad.append((root / "merger", "does not apply LoRA to"))
    make_adapter(load_pretrained(tiny_zoo["llava_1_5_tiny"])[0], root / "llava", ["k_proj"], 4, 4, seed=1)
    bad.append((root / "llava", "another base model"))
    make_adapter(qwen, root / "wide", ["q_proj"], 32, 32, seed=2)
    bad.append((root / "wide", "exceeds the server's max_lora_rank 16"))
    p = copy("head_size")
    make_head(p / "heads" / "signs", "binary", hidden=64, seed=0)
    bad.append((p, "reads hidden size 64"))
    return bad


def test_bad_adapter_directories_are_refused_and_nothing_else_changes(tiny_zoo, adapters, tmp_path):
    engine = _engine(tiny_zoo, adapters, names=("a", "b"), adapter_slots=2, max_lora_rank=16)
    expected = engine.generate(_request(7, "a", max_new=12)).token_ids
    def served():
        return [(a["name"], a["path"], a["ranks"], a["version"]) for a in engine.list_adapters()]

    before = served()
    rid = engine.add_request(_request(7, "a", max_new=12))
    final = None
    for path, message in _corruptions(adapters, tiny_zoo, tmp_path):
        with pytest.raises(AdapterLoadError, match=message):
            engine.load_adapter("new", path)
        assert served() == before
        final = next((o for o in engine.step() if o.finished), final)
    while engine.has_unfinished():
        final = next((o for o in engine.step() if o.finished), final)
    assert final.request_id == rid and final.token_ids == expected
    with pytest.raises(ValueError, match="already loaded"):
        engine.load_adapter("a", adapters["c"])


class _SlowSwaps(AdapterGate):
    """An adapter side whose swaps take `steps` scheduling passes to land (as on a GPU)."""

    def __init__(self, steps: int):
        self.left = {"slow": steps}
        self.held: dict[str, int] = {}

    def ready(self, adapter):
        self.left[adapter] = self.left.get(adapter, 0) - 1
        return self.left[adapter] < 0

    def acquire(self, adapter):
        self.held[adapter] = self.held.get(adapter, 0) + 1

    def release(self, adapter):
        self.held[adapter] -= 1


def test_a_request_waiting_for_its_swap_does_not_hold_up_the_queue():
    gate = _SlowSwaps(steps=2)
    scheduler = Scheduler(SchedulerConfig(max_batch_size=8, max_tokens_per_step=64), BlockManager(32, 4),
                          adapters=gate)
    seqs = [Sequence(name, [1, 2, 3, 4, 5], max_tokens=2, arrival_time=t, adapter=adapter)
            for t, (name, adapter) in enumerate([("s0", "slow"), ("s1", None), ("s2", "fast")])]
    for seq in seqs:
        scheduler.add(seq)
    first = scheduler.schedule()
    assert [s.request_id for s, _ in first.entries] == ["s1", "s2"]  # s0 waits; those behind it go on
    scheduler.postprocess(first, {seqs[1].seq_id: 7, seqs[2].seq_id: 7})
    second = scheduler.schedule()
    assert [s.request_id for s, _ in second.entries] == ["s1", "s2"]
    assert scheduler.postprocess(second, {seqs[1].seq_id: 7, seqs[2].seq_id: 7}) == seqs[1:]  # both done
    assert [s.request_id for s, _ in scheduler.schedule().entries] == ["s0"]  # its swap has landed
    assert gate.held == {"fast": 0, "slow": 1}  # finished sequences let their adapter go
    scheduler.abort("s0")
    assert gate.held == {"fast": 0, "slow": 0}
