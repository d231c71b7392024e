"""bench.results.write_csv: the header holds every row's keys, so a column only some rows have
(cuBLAS times on one-adapter rows) neither fails the write nor is dropped."""

from __future__ import annotations

import csv

import pytest

from bench.results import write_csv


def test_the_header_is_every_rows_keys_in_the_order_first_seen(tmp_path):
    rows = [{"tokens": 1024, "mix": "distinct", "atmm_us": 20.0},
            {"tokens": 1024, "mix": "identical", "atmm_us": 15.6, "dense_us": 19.1}]
    path = write_csv(tmp_path / "parts.csv", rows)
    with open(path) as f:
        got = list(csv.DictReader(f))
    assert list(got[0]) == ["tokens", "mix", "atmm_us", "dense_us"]
    assert got[0]["dense_us"] == "" and got[1]["dense_us"] == "19.1"


def test_given_columns_still_refuse_a_key_outside_them_unless_dropped(tmp_path):
    rows = [{"a": 1, "b": 2}]
    with pytest.raises(ValueError, match="fields not in fieldnames"):
        write_csv(tmp_path / "x.csv", rows, columns=["a"])
    path = write_csv(tmp_path / "y.csv", rows, columns=["a"], drop_extra=True)
    assert path.read_text().splitlines() == ["a", "1"]
