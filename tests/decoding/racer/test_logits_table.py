"""The logits table: learning from prompt / verify top-k, and persistence per model."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from decoding.drafters.racer.logits_table import LogitsTable, LogitsTableError, table_path


def test_update_keeps_the_last_occurrence_and_ignores_out_of_vocabulary_rows() -> None:
    table = LogitsTable(100, k=3)
    written = table.update([5, 6, 5, 200], torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 1, 1]]))
    assert written == 2
    assert table.next_tokens(5, 3) == [7, 8, 9]  # the last time 5 was read
    assert table.next_tokens(6, 2) == [4, 5]
    assert 200 not in table and 7 not in table
    assert table.rows_filled == 2


def test_update_pads_a_smaller_k_and_truncates_a_larger_one() -> None:
    table = LogitsTable(50, k=4)
    table.update([1], np.array([[3, 4]]))
    assert table.next_tokens(1, 4) == [3, 4]
    table.update([2], np.array([[9, 8, 7, 6, 5, 4]]))
    assert table.next_tokens(2, 8) == [9, 8, 7, 6]
    with pytest.raises(ValueError):
        table.update([1, 2], np.array([1, 2]))


def test_save_load_round_trip(tmp_path: Path) -> None:
    table = LogitsTable.open(tmp_path, "org/model-a", 64, k=4)
    table.update([3, 4], np.array([[1, 2, 3, 4], [5, 6, 7, 8]]))
    assert table.autosave(force=True)
    path = table_path(tmp_path, "org/model-a")
    assert path.exists() and path.parent == tmp_path
    again = LogitsTable.open(tmp_path, "org/model-a", 64, k=4)
    assert np.array_equal(again.table, table.table) and np.array_equal(again.filled, table.filled)
    assert again.next_tokens(4, 2) == [5, 6]
    other = LogitsTable.open(tmp_path, "org/model-b", 64, k=4)  # per model: another file
    assert other.rows_filled == 0


def test_load_rejects_a_mismatch_and_open_starts_fresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    table = LogitsTable.open(tmp_path, "m", 64, k=4)
    table.update([1], np.array([[2, 3, 4, 5]]))
    table.save()
    with pytest.raises(LogitsTableError):
        LogitsTable.load(table_path(tmp_path, "m"), vocab_size=65)
    with caplog.at_level(logging.WARNING):
        fresh = LogitsTable.open(tmp_path, "m", 65, k=4)
    assert fresh.rows_filled == 0 and "vocab_size" in caplog.text
    table_path(tmp_path, "broken").write_bytes(b"not a table")
    with pytest.raises(LogitsTableError):
        LogitsTable.load(table_path(tmp_path, "broken"))
    assert LogitsTable.open(tmp_path, "broken", 8).rows_filled == 0


def test_autosave_waits_for_the_interval_and_for_changes(tmp_path: Path) -> None:
    table = LogitsTable.open(tmp_path, "m", 16, k=2, save_interval_s=3600)
    assert not table.autosave()  # nothing changed
    table.update([1], np.array([[2, 3]]))
    assert not table.autosave()  # interval not reached
    assert table.autosave(force=True)
    assert not table.autosave(force=True)  # clean again
    memory_only = LogitsTable.open(None, "m", 16)
    memory_only.update([1], np.array([[2, 3]]))
    assert not memory_only.autosave(force=True)
    with pytest.raises(LogitsTableError):
        memory_only.save()
