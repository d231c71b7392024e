"""A tensor-parallel rank builds and reads only its shard (serve/models/parallel.py): the weights equal
the whole model loaded and then cut (`shard_model`), from safetensors, from FP8 checkpoints dequantized
at load and from random weights made on demand; no whole projection is ever allocated; and the
engines of two gloo ranks hold exactly those shards."""

from __future__ import annotations

import faulthandler
import os

import pytest
import torch
import torch.multiprocessing as mp
from fp8_checkpoints import write_fp8_checkpoint

from serve.distributed import free_port
from serve.models import RandomWeights, load_model
from serve.models.parallel import TPGroup, shard_model

RANK_TIMEOUT_S = int(os.environ.get("VLORA_TEST_RANK_TIMEOUT_S", 600))


@pytest.fixture(scope="module")
def ckpt(vlora_home):
    from zoo import build_checkpoint

    return build_checkpoint("qwen2_vl_tiny", vlora_home / "zoo" / "qwen2_vl_tiny")


def _mismatches(whole, cut) -> list[str]:
    a, b = whole.state_dict(), cut.state_dict()
    if a.keys() != b.keys():
        return sorted(set(a) ^ set(b))
    return [k for k in a if a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("source", ["safetensors", "random", "fp8_channel", "fp8_block"])
def test_a_shard_built_at_load_equals_the_whole_model_cut_after(ckpt, tmp_path, source):
    path, weights = ckpt, None
    if source == "random":
        weights = RandomWeights(ckpt, seed=3, dtype=torch.float32)
    elif source.startswith("fp8"):  # dequantized at load (quantization=none), then cut
        path = write_fp8_checkpoint(ckpt, tmp_path / source, "fbgemm_fp8" if source == "fp8_channel" else "fp8_block")
    for rank in (0, 1):
        whole, _ = load_model(path, weights=weights)
        shard_model(whole, TPGroup(rank, 2))
        cut, _ = load_model(path, weights=weights, tp=TPGroup(rank, 2))
        assert not _mismatches(whole, cut), (rank, _mismatches(whole, cut)[:5])
        assert cut.args == whole.args and cut.args.num_heads == 2 and cut.args.intermediate_size == 256
        assert cut.tp.rank == rank and cut.vision.mode == "split"
        qkv = cut.language_model.layers[0].attn.qkv_proj
        assert qkv.tp_shard == ("out", rank, 2) and qkv.output_slices == (64, 32, 32)


def test_no_whole_projection_is_allocated(ckpt):
    from torch.overrides import TorchFunctionMode

    # what allocates a tensor's memory (views of a checkpoint file or of a parameter do not)
    factories = {torch.empty, torch.zeros, torch.ones, torch.full, torch.empty_like, torch.zeros_like,
                 torch.ones_like, torch.empty_strided, torch.Tensor.new_empty, torch.Tensor.new_zeros}

    class Shapes(TorchFunctionMode):
        """Shapes of the tensors allocated off the meta device."""

        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in factories and out.device.type != "meta":
                self.seen.add(tuple(out.shape))
            return out

    # the tiny model's whole qkv_proj [256, 128], gate_up_proj [1024, 128] and down_proj [128, 512]
    whole = {(256, 128), (1024, 128), (128, 512)}
    with Shapes() as cut:
        load_model(ckpt, tp=TPGroup(1, 2))
    assert not cut.seen & whole and {(128, 128), (512, 128), (128, 256)} <= cut.seen  # the halves were
    with Shapes() as loaded:  # the check sees whole projections where they are made
        shard_model(load_model(ckpt)[0], TPGroup(1, 2))
    assert whole <= loaded.seen


def test_bad_splits_are_refused_before_anything_is_built(ckpt):
    with pytest.raises(ValueError, match="multiple of 3"):
        load_model(ckpt, tp=TPGroup(0, 3))
    with pytest.raises(ValueError, match="tp_vision='halves'"):
        load_model(ckpt, tp=TPGroup(0, 2), tp_vision="halves")
    with pytest.raises(ValueError, match="tensor parallel"):
        load_model(ckpt, tp=TPGroup(0, 2), quantization="fp8")


def _rank(rank: int, port: int, ckpt: str, out: str) -> None:
    """Both engines of this rank (checkpoint, random weights) against the whole model cut afterwards."""
    from serve import Engine, EngineConfig
    from serve.distributed import join_group, leave_group

    faulthandler.dump_traceback_later(RANK_TIMEOUT_S, exit=True)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    join_group("cpu", rank, rank, 2)
    found = {}
    try:
        config = EngineConfig(device="cpu", dtype="float32", tensor_parallel_size=2, adapter_slots=0,
                              num_kv_blocks=32, enable_prefix_cache=False)
        for name, weights in (("checkpoint", None), ("random", RandomWeights(ckpt, seed=7, dtype="float32"))):
            engine = Engine(ckpt, config, weights=weights)
            whole, _ = load_model(ckpt, weights=weights)
            shard_model(whole, engine.model.tp)
            embed = engine.model.language_model.embed_tokens.weight
            found[name] = (_mismatches(whole, engine.model), float(embed.double().sum()))
        torch.save(found, f"{out}.{rank}")
    finally:
        leave_group(None)


def test_engines_of_two_gloo_ranks_hold_the_load_then_shard_weights(ckpt, tmp_path):
    out = str(tmp_path / "ranks")
    mp.spawn(_rank, args=(free_port(), str(ckpt), out), nprocs=2, join=True)
    ranks = [torch.load(f"{out}.{r}") for r in (0, 1)]
    for found in ranks:
        assert found["checkpoint"][0] == [] and found["random"][0] == []
    # every rank drew the same whole tensors (the unsplit embedding shows it)
    assert ranks[0]["random"][1] == ranks[1]["random"][1] != ranks[0]["checkpoint"][1]
