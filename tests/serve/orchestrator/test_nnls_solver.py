"""The learnt cost model's solver (serve/orchestrator/nnls.py) gives every weight bit for bit as the
plain active-set elimination it replaced (kept below as the reference), on systems shaped like the
learner's: features of very different scales (row swaps), equal columns (pivot ties), parts never
seen (alone) and priors that drive several parts below 0 (second and later solves, resumed or not)."""

from __future__ import annotations

import random
import struct

import pytest

from serve.orchestrator import nnls
from serve.orchestrator.learned import FEATURES, LearnedCosts
from serve.orchestrator.nnls import Elimination, nonnegative_solve, system
from serve.orchestrator.types import Mode

from orchestrator_cases import linear_profile

NONNEGATIVE = range(3, 9)


# ---- the refit as it was before the solver (learned.py, 2026-11-27) -------------------------------
def _eliminate(m: list[list[float]]) -> list[float]:
    n = len(m)
    for c in range(n):
        col = [abs(m[r][c]) for r in range(c, n)]
        p = c + col.index(max(col))
        m[c], m[p] = m[p], m[c]
        top = m[c]
        pivot = top[c]
        tail = top[c:]
        for r in range(c + 1, n):
            row = m[r]
            f = row[c] / pivot
            if f:
                row[c:] = [v - f * t for v, t in zip(row[c:], tail)]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        row = m[r]
        x[r] = (row[n] - sum([row[k] * x[k] for k in range(r + 1, n)])) / row[r]
    return x


def reference_solve(xx, ridge, b, nonnegative: range) -> list[float]:
    n = len(b)
    free = list(range(n))
    for _ in range(len(nonnegative)):
        w = _eliminate([[xx[i][j] + (ridge[i] if i == j else 0.0) for j in free] + [b[i]] for i in free])
        weights = [0.0] * n
        for i, v in zip(free, w):
            weights[i] = v
        negative = [i for i in free if i in nonnegative and weights[i] < 0]
        if not negative:
            break
        free.remove(min(negative, key=lambda i: weights[i]))
    return [max(0.0, v) if i in nonnegative else v for i, v in enumerate(weights)]


def bits(values: list[float]) -> list[bytes]:
    return [struct.pack("<d", v) for v in values]  # -0.0 and 0.0 differ here


def random_system(rng: random.Random, alone: set[int]):
    """x x^T, ridge and x y + ridge * prior of a few steps, as LearnedCosts sums them."""
    n = 9
    steps = [[rng.choice([0.0, 1.0, rng.uniform(0, 3), rng.uniform(0, 400)]) for _ in range(n)]
             for _ in range(rng.randint(1, 12))]
    ties = rng.random() < 0.3  # two equal features (one sequence a step: host == host_per_seq): pivot ties
    for x in steps:
        x[1] = x[0] if ties else x[1]
        for j in alone:
            x[j] = 0.0
    y = [rng.uniform(-20, 60) for _ in steps]
    xx = [[sum(x[i] * x[j] for x in steps) for j in range(n)] for i in range(n)]
    ridge = [rng.choice([1e-6, 1e-3, 0.5, 8.0]) for _ in range(n)]
    b = [sum(x[i] * v for x, v in zip(steps, y)) + ridge[i] * rng.choice([0.0, 1.0, -1.0, -5.0]) for i in range(n)]
    return xx, ridge, b


def test_every_weight_is_bit_for_bit_the_plain_eliminations(monkeypatch):
    paths = {"resumed": 0, "from scratch": 0, "dropped": 0}
    without = Elimination.without

    def counted(self, var):
        out = without(self, var)
        paths["resumed" if out is not None else "from scratch"] += 1
        return out

    monkeypatch.setattr(Elimination, "without", counted)
    rng = random.Random(48)
    for case in range(1500):
        alone = set(rng.sample(range(9), rng.choice([0, 0, 1, 2])))
        xx, ridge, b = random_system(rng, alone)
        want = reference_solve(xx, ridge, b, NONNEGATIVE)
        assert bits(nonnegative_solve(xx, ridge, b, NONNEGATIVE, alone)) == bits(want), case
        assert bits(nonnegative_solve(xx, ridge, b, NONNEGATIVE)) == bits(want), case
        paths["dropped"] += sum(w == 0.0 for w in want[3:])
    # both ways of the second solve were taken, many times
    assert paths["resumed"] > 2000 and paths["from scratch"] > 2000 and paths["dropped"] > 2000, paths


def test_the_resumed_system_is_the_one_eliminated_from_scratch():
    rng = random.Random(7)
    for _ in range(200):
        xx, ridge, b = random_system(rng, set())
        free = list(range(9))
        full = Elimination(free).run(system(xx, ridge, b, free), free)
        for var in free:
            rest = [i for i in free if i != var]
            resumed = full.without(var)
            if resumed is None:
                assert var in full.pivots[:free.index(var)]
                continue
            fresh = Elimination(rest).run(system(xx, ridge, b, rest), rest)
            assert resumed.pivots == fresh.pivots and resumed.variables == fresh.variables
            assert [bits(u) for u in resumed.upper] == [bits(u) for u in fresh.upper]
            assert bits(resumed.solve()) == bits(_eliminate(system(xx, ridge, b, rest)))


def test_a_part_never_seen_is_solved_alone_and_keeps_the_profiles_weight():
    costs = LearnedCosts(linear_profile())
    for k in range(40):  # unmerge (ATMM) and mixture (deLoRA) steps, never einsum, no images
        mode = Mode.unmerge() if k % 3 else Mode.mixture("a")
        batch = [("a", 1), ("b", 1 + k % 5), (None, 7)]
        costs.observe(mode, batch, 20.0 + k % 7)
    assert costs._unseen == {FEATURES.index("lora_einsum"), FEATURES.index("image_ktokens")}
    assert costs.weights[FEATURES.index("lora_einsum")] == 1.0  # the prior: b / ridge exactly
    costs.observe(Mode.unmerge(), [("a", 1)], 20.0, lora_op="atmm", image_tokens=256)
    assert costs._unseen == {FEATURES.index("lora_einsum")}


@pytest.mark.parametrize("alone", [set(), {6}])
def test_a_singular_system_fails_as_the_plain_elimination_does(alone):
    n = 9
    xx = [[0.0] * n for _ in range(n)]
    ridge = [0.0] * n  # no ridge, no data: nothing to pivot on
    with pytest.raises(ZeroDivisionError):
        reference_solve(xx, ridge, [1.0] * n, NONNEGATIVE)
    with pytest.raises(ZeroDivisionError):
        nnls.nonnegative_solve(xx, ridge, [1.0] * n, NONNEGATIVE, alone)


def test_the_learnt_weights_are_the_plain_refits_while_parts_are_first_seen_late():
    """Each step's weights against the refit as it was (every sum over every part, then the plain
    elimination), while deLoRA, then images, are first seen mid-way (einsum never): a part's
    solved-alone or skipped row must end the step it is first seen non-zero."""
    costs = LearnedCosts(linear_profile())
    n, lam = len(FEATURES), costs.forget
    scale, xy, xx = [1.0] * n, [0.0] * n, [[0.0] * n for _ in range(n)]
    rng = random.Random(3)
    for k in range(60):
        mode = Mode.mixture("a") if k >= 10 and k % 2 else Mode.unmerge()
        batch = [("a", 1), ("b", rng.randint(1, 300)), (None, 3)][:1 + k % 3]
        images = 256 * (k % 4 == 0) if k >= 20 else 0
        seqs, tokens, lora_tokens, adapters, op = costs.batch_shape(mode, batch)
        x = costs.features(seqs, tokens, lora_tokens, adapters, op, images)
        fitted = costs.predict(x)
        measured = fitted * rng.uniform(0.7, 1.6) + 1.0
        spread = costs._spread
        costs.observe(mode, batch, measured, image_tokens=images)
        # the sums as LearnedCosts kept them before (the Huber weight from the same running spread)
        rel = abs(measured - fitted) / max(fitted, 1e-3)
        limit = 2.0 * max(spread * __import__("math").exp(0.05 if rel > spread else -0.05), 0.02)
        weight = 1.0 if rel <= limit else limit / rel
        for i in range(n):
            scale[i] = lam * scale[i] + (1 - lam) * abs(x[i]) if k else max(abs(x[i]), 1e-3)
            xi = weight * x[i]
            xy[i] = lam * xy[i] + xi * measured
            xx[i] = [lam * r + xi * v for r, v in zip(xx[i], x)]
        ridge = [costs.prior_steps * max(s, 1e-3) ** 2 for s in scale]
        prior = [0.0, 0.0, 0.0, *[1.0] * (n - 4), 0.0]
        b = [xy[i] + ridge[i] * prior[i] for i in range(n)]
        assert bits(costs.weights) == bits(reference_solve(xx, ridge, b, NONNEGATIVE)), k
    assert costs._unseen == {FEATURES.index("lora_einsum")}
