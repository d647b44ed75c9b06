"""Plan nodes against the machines their workers landed on (pure logic; the driver's side is in test_inbox)."""

import pytest

from osdp_platform.runtime.placement import split_plan_nodes, split_warning

A, B, C = 0, 1, 2


@pytest.mark.parametrize(
    ("machines", "workers_per_node", "split"),
    [
        ([A] * 4 + [B] * 4, 4, []),  # one plan node per machine
        ([A] * 8, 4, []),  # two plan nodes on one machine
        ([A] * 6 + [B] * 2, 4, [1]),  # machines of 6 and 4: PACK fills the first, plan node 1 straddles
        ([A] * 3 + [B] * 3 + [C] * 2, 4, [0, 1]),
        ([A, B, A, B], 2, [0, 1]),
        ([A, B], 1, []),  # a plan node of one worker is always on one machine
    ],
)
def test_a_plan_node_is_split_when_its_ranks_run_on_more_than_one_machine(
    machines: list[int], workers_per_node: int, split: list[int]
) -> None:
    assert split_plan_nodes(machines, workers_per_node) == split


def test_the_warning_names_each_split_node_its_ranks_machines_and_the_fix() -> None:
    assert split_warning([A] * 4 + [B] * 4, 4) is None
    said = split_warning([A] * 6 + [B] * 2, 4)
    assert said is not None and said.startswith("plan node 1 (ranks 4-7) on machines 0, 1:")
    assert "hardware.workers_per_node (4)" in said and "plan node 0" not in said


def test_a_warning_names_the_first_split_nodes_and_counts_the_rest() -> None:
    said = split_warning([A, B] * 10, 2)
    assert said is not None and "plan node 3 (ranks 6-7)" in said and "plan node 4" not in said
    assert "and 6 more plan nodes" in said
