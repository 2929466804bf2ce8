"""bench.decode's method order: no method always measured in the same place of a prompt's repetition."""

from __future__ import annotations

from bench.decode import method_order


def test_each_method_takes_every_position_once_over_as_many_turns() -> None:
    names = ["autoregressive", "suffix", "auto", "rapid@2048"]
    orders = [method_order(names, turn) for turn in range(7, 7 + len(names))]
    assert all(sorted(order) == sorted(names) for order in orders)
    for position in range(len(names)):
        assert sorted(order[position] for order in orders) == sorted(names)
    assert method_order(names, 0) == names and method_order(names, len(names)) == names
