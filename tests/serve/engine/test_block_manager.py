"""Block manager: allocation, growth, freeing, reference counts, prefix sharing and its keys."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from serve.engine.block_manager import BlockManager
from serve.engine.sequence import MMSpan, Sequence


def _seq(tokens, adapter=None, spans=(), name="r"):
    return Sequence(name, list(tokens), max_tokens=8, adapter=adapter, mm_spans=tuple(spans))


def test_the_block_manager_and_scheduler_never_import_torch():
    # a fresh interpreter importing them as any caller would, through the package faces
    code = ("import sys\n"
            "import serve.engine.block_manager, serve.engine.scheduler\n"
            "print(sorted(m for m in ('torch', 'numpy', 'triton') if m in sys.modules))")
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == "[]"


def test_allocate_grow_and_free_return_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = _seq(range(10))
    assert bm.can_allocate(seq, 10)
    assert bm.allocate(seq, 10) == 0
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    seq.num_computed_tokens = 10
    for t in (10, 11):  # grow inside the last block, then into a new one
        seq.append(t)
        assert bm.can_append(seq, 1)
        bm.append(seq, 1)
        seq.num_computed_tokens += 1
    assert len(seq.block_table) == 3
    seq.append(12)
    bm.append(seq, 1)
    assert len(seq.block_table) == 4 and len(set(seq.block_table)) == 4
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 8 and bm.num_used_blocks == 0


def test_can_allocate_and_can_append_refuse_what_does_not_fit():
    bm = BlockManager(num_blocks=3, block_size=4)
    a, b = _seq(range(8), name="a"), _seq(range(100, 105), name="b")
    bm.allocate(a, 8)
    assert not bm.can_allocate(b, 5)  # needs 2 blocks, 1 free
    assert bm.can_allocate(b, 4)
    with pytest.raises(RuntimeError, match="can_allocate"):
        bm.allocate(b, 5)
    a.num_computed_tokens = 8
    assert bm.can_append(a, 4) and not bm.can_append(a, 5)
    with pytest.raises(RuntimeError, match="can_append"):
        bm.append(a, 5)


def test_a_computed_prefix_is_shared_and_reference_counted():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = _seq(list(range(11)), name="a")
    bm.allocate(a, 11)
    a.num_computed_tokens = 11
    bm.commit(a)  # blocks 0 and 1 are full and computed; block 2 holds 3 tokens
    b = _seq(list(range(9)) + [99, 98], name="b")  # shares the first 8 tokens (2 blocks)
    assert bm.num_cached_tokens(b) == 8
    assert bm.allocate(b, 11) == 8 and b.num_computed_tokens == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1]
    bm.free(b)
    assert bm.num_used_blocks == 0


def test_a_whole_cached_prompt_still_leaves_its_last_token_to_compute():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = _seq(range(8), name="a")
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.commit(a)
    b = _seq(range(8), name="b")
    assert bm.num_cached_tokens(b) == 4  # not 8: the last block is recomputed for the logits


def test_freed_blocks_stay_findable_until_handed_out_again():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = _seq(range(9), name="a")
    bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.commit(a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = _seq(range(9), name="b")
    assert bm.can_allocate(b, 9) and bm.allocate(b, 9) == 8  # revived from the free list
    bm.free(b)
    c = _seq(range(500, 516), name="c")  # takes all four blocks: the old content is evicted
    bm.allocate(c, 16)
    bm.free(c)
    assert bm.num_cached_tokens(_seq(range(9), name="d")) == 0


def test_prefix_keys_include_the_images_and_the_adapter():
    bm = BlockManager(num_blocks=16, block_size=4)
    tokens = [1, 2, 7, 7, 7, 7, 3, 4, 5, 6]  # placeholders of one image at [2, 6)
    a = _seq(tokens, spans=[MMSpan(2, 6, "img-a")], name="a")
    bm.allocate(a, 10)
    a.num_computed_tokens = 10
    bm.commit(a)
    same = _seq(tokens, spans=[MMSpan(2, 6, "img-a")], name="same")
    other_image = _seq(tokens, spans=[MMSpan(2, 6, "img-b")], name="other")
    other_adapter = _seq(tokens, spans=[MMSpan(2, 6, "img-a")], adapter="lora-1", name="adapter")
    assert bm.num_cached_tokens(same) == 8
    assert bm.num_cached_tokens(other_image) == 0  # block 0 already covers the image's first tokens
    assert bm.num_cached_tokens(other_adapter) == 0


def test_a_prompts_block_keys_are_built_once_however_often_it_is_matched(monkeypatch):
    # the scheduler matches each waiting prompt several times a step, every step it waits
    bm = BlockManager(num_blocks=16, block_size=4)
    a = _seq(range(13), name="a")
    bm.allocate(a, 13)
    a.num_computed_tokens = 13
    bm.commit(a)
    built = []
    make = bm._block_key
    monkeypatch.setattr(bm, "_block_key", lambda seq, i, parent: built.append(i) or make(seq, i, parent))
    waiting = _seq(list(range(12)) + [50, 51], name="w")
    for _ in range(5):
        assert bm.num_cached_tokens(waiting) == 12 and bm.can_allocate(waiting, 14)
    assert built == [0, 1, 2]  # each full block once; the keys it kept still decide the hits
    bm.allocate(waiting, 14)
    assert waiting.block_table[:3] == a.block_table[:3] and built == [0, 1, 2]


def test_prefix_cache_can_be_switched_off():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_cache=False)
    a = _seq(range(9), name="a")
    bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.commit(a)
    assert bm.num_cached_tokens(_seq(range(9), name="b")) == 0


def test_bad_sizes_and_double_allocation_are_refused():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
    bm = BlockManager(4, 4)
    seq = _seq(range(3))
    bm.allocate(seq, 3)
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.allocate(seq, 3)
    with pytest.raises(ValueError, match="no tokens"):
        _seq([])

