"""The logits table: learning from prompt / verify top-k."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decoding.drafters.racer.logits_table import LogitsTable


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
