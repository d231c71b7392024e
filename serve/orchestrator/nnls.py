"""The learnt cost model's solver: normal equations with some parts held non-negative (an active
set), by Gaussian elimination with partial pivoting.

`LearnedCosts` refits after every served step, on the engine's step loop (the host, in series with
the GPU), so this is on the hot path. It performs exactly the floating-point operations of the plain
algorithm (the refit as it was, kept in tests/serve/orchestrator/test_nnls_solver.py): every weight comes out bit for bit the same,
hence every price and decision. What it leaves out is work whose result is never read:

- the entries below the diagonal (each row is kept from its pivot column on, a "tail");
- most of the active set's second solve. When a part comes out negative it is dropped and the
  rest solved again. Its elimination repeats the first one's up to that part's column, as long
  as the dropped part's row was never a pivot before it (then no row swap moved it, the other rows
  stand in the same order and every pivot search picks the same row); so the second solve resumes
  from the first one's rows at that column, less the dropped part's row and column.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from operator import itemgetter, mul

first = itemgetter(0)


class Elimination:
    """One system eliminated: upper[c] is the pivot row of column c from column c on (its last
    entry the right-hand side), pivots[c] its variable; states[c] = (rows, variables) left before
    column c, each row from column c on (None where not kept)."""

    def __init__(self, variables: list[int]):
        self.variables = variables  # the system's unknowns, in column order
        self.upper: list[list[float]] = []
        self.pivots: list[int] = []
        self.states: list[tuple[list[list[float]], list[int]] | None] = []
        self._x: list[float] | None = None  # the back-substitution so far: columns _solved on
        self._solved = 0

    def run(self, rows: list[list[float]], ids: list[int]) -> Elimination:
        """Eliminates `rows` (ids: the variable of each row's equation) from column len(upper) on."""
        upper, pivots, states = self.upper, self.pivots, self.states
        while rows:
            states.append((rows, ids))  # never changed below: a row is replaced, not written into
            col = list(map(abs, map(first, rows)))
            p = col.index(max(col))  # the first largest, as the plain algorithm picks it
            if p:
                rows, ids = rows[:], ids[:]
                rows[0], rows[p] = rows[p], rows[0]
                ids[0], ids[p] = ids[p], ids[0]
            top = rows[0]
            pivot, tail = top[0], top[1:]
            upper.append(top)
            pivots.append(ids[0])
            # each row less f * the pivot row, entry by entry as the plain algorithm computes it (its
            # column-c entry, never read again, left out); a row with f == 0 is left as it is
            rows = [[v - f * t for v, t in zip(row[1:], tail)] if (f := row[0] / pivot) else row[1:]
                    for row in rows[1:]]
            ids = ids[1:]
        return self

    def solve(self, down_to: int = 0) -> list[float]:
        """Back-substitution, the unknowns in column order, from the last column down to `down_to`
        (the columns before it stay 0.0 until a later call asks for them: a solve whose non-negative
        parts come out negative is dropped without its first columns, the host terms)."""
        if self._x is None:
            self._x, self._solved = [0.0] * len(self.upper), len(self.upper)
        x = self._x
        for r in range(self._solved - 1, down_to - 1, -1):
            row = self.upper[r]
            x[r] = (row[-1] - sum(map(mul, row[1:-1], x[r + 1:]))) / row[0]  # (the same sum, in the same order)
        self._solved = min(self._solved, down_to)
        return x

    def without(self, var: int) -> Elimination | None:
        """The system less `var` (its equation and its unknown), resumed from this one's rows at its
        column; None where the plain algorithm's elimination of that system could differ (the
        dropped row was a pivot before its column) or the rows there were not kept."""
        pos = self.variables.index(var)
        if var in self.pivots[:pos] or pos >= len(self.states) or self.states[pos] is None:
            return None
        out = Elimination(self.variables[:pos] + self.variables[pos + 1:])
        # columns before pos: the same pivot rows, less their entry in the dropped column
        out.upper = [u[:pos - c] + u[pos - c + 1:] for c, u in enumerate(self.upper[:pos])]
        out.pivots = self.pivots[:pos]
        out.states = [None] * pos
        rows, ids = self.states[pos]
        k = ids.index(var)
        return out.run([r[1:] for i, r in enumerate(rows) if i != k], ids[:k] + ids[k + 1:])


def system(xx: Sequence[Sequence[float]], ridge: Sequence[float], b: Sequence[float],
           free: Sequence[int]) -> list[list[float]]:
    """The free parts' normal equations: x x^T plus the ridge on its diagonal | x y plus the prior
    (each entry xx + 0.0 off the diagonal, as the plain algorithm built it: a -0.0 comes out 0.0)."""
    rows = []
    for k, i in enumerate(free):
        xi = xx[i]
        row = [xi[j] + 0.0 for j in free]
        row[k] = xi[i] + ridge[i]
        row.append(b[i])
        rows.append(row)
    return rows


def nonnegative_solve(xx: Sequence[Sequence[float]], ridge: Sequence[float], b: Sequence[float],
                      nonnegative: range, alone: Collection[int] = ()) -> list[float]:
    """Weights of (xx + diag(ridge)) w = b with the parts in `nonnegative` held at >= 0: a part
    fitted below 0 is held at 0 and the rest refit, the most negative first, up to one pass per
    such part (each weight as the plain algorithm gives it, bit for bit).

    alone: parts whose row and column of xx are all zero off the diagonal (a feature never seen
    non-zero, such as a LoRA operator the policy never runs). Each is its own equation: the plain
    elimination never chooses its row as a pivot before its column (0 there), leaves it unchanged
    and the other rows' order too, does nothing at its column (every other row's factor is 0), and
    adds 0 * w_j to the other rows' back-substitution sums, which never changes a sum (Python's sum
    starts at +0.0, never -0.0). So its weight is b_j / (xx_jj + ridge_j) and the others' are those of
    the system without it, bit for bit."""
    n = len(b)
    free = list(range(n))
    coupled = [i for i in free if i not in alone]
    elim = Elimination(coupled).run(system(xx, ridge, b, coupled), coupled)
    passes = len(nonnegative)
    # the columns of non-negative parts first: if one is negative, this solve is dropped (but the last
    # pass's weights stand whatever they are). Only such parts are dropped: the columns before stay.
    first = next((c for c, i in enumerate(coupled) if i in nonnegative), 0)
    for k in range(passes):
        weights = [0.0] * n
        for i, v in zip(elim.variables, elim.solve(first if k + 1 < passes else 0)):
            weights[i] = v
        for j in alone:
            if j in free:
                weights[j] = b[j] / (xx[j][j] + ridge[j])
        negative = [i for i in free if i in nonnegative and weights[i] < 0]
        if not negative:
            for i, v in zip(elim.variables, elim.solve()):  # the rest of the columns: these weights stand
                weights[i] = v
            break
        drop = min(negative, key=lambda i: weights[i])
        free.remove(drop)
        if drop not in alone:
            rest = [i for i in elim.variables if i != drop]
            elim = elim.without(drop) or Elimination(rest).run(system(xx, ridge, b, rest), rest)
    return [max(0.0, v) if i in nonnegative else v for i, v in enumerate(weights)]
