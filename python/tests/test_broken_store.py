"""The conformance suite catches a store that breaks a rule.

A store written in Python (tests/pystore.py) runs the suite's tests with
and without a fault: each fault fails the tests of its rule with an
AssertionError, and the same tests pass once the fault is off (so they
fail for the fault, not for the Python store).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

from agentstate_rs.testing import StateStoreConformance
from pystore import PyStateStore


def run(factory: Callable[[Any], Any], test: str) -> None:
    class Suite(StateStoreConformance):
        def make_store(self) -> Any:
            return factory(self.clock)

    getattr(Suite(), test)()


RIGHT = lambda clock: PyStateStore(clock)  # noqa: E731
UNSCRUBBED = lambda clock: PyStateStore(clock, scrub=False)  # noqa: E731
BY_CLOCK = lambda clock: PyStateStore(clock, order="updated_at")  # noqa: E731

BASICS = [
    "test_r1_create_at_zero_commits_at_one",
    "test_r2_update_at_n_commits_at_n_plus_one",
    "test_r2_stale_write_raises_conflict_with_both_versions",
    "test_r2_create_race_has_one_winner",
    "test_r2_versioned_race_one_winner_per_round_across_threads",
    "test_r4_patch_adds_and_bumps_the_version",
    "test_r4_patches_commute_across_tasks",
    "test_r4_patches_commute_across_threads",
    "test_x1_tool_call_arguments_are_scrubbed_on_write",
    "test_l1_walk_visits_every_record_once_in_insertion_order",
    "test_l2_walk_while_others_write_sees_each_record_once",
    "test_l3_order_is_the_stores_counter_never_the_clock",
    "test_l7_next_page_with_only_the_cursor_keeps_the_filters",
    "test_l6_cursor_with_another_tenant_or_filters_is_invalid",
    "test_tenant_isolation_on_reads_and_listings",
    "test_s2_delete_session_with_live_runs_raises_in_use_cascade_deletes",
]


@pytest.mark.parametrize("test", BASICS)
def test_a_python_store_that_keeps_the_rules_passes(test: str) -> None:
    run(RIGHT, test)


def test_a_store_that_writes_unscrubbed_fails_the_scrubbing_test() -> None:
    with pytest.raises(AssertionError, match="unscrubbed"):
        run(UNSCRUBBED, "test_x1_tool_call_arguments_are_scrubbed_on_write")


@pytest.mark.parametrize(
    "test",
    [
        "test_l3_order_is_the_stores_counter_never_the_clock",
        "test_l2_walk_while_others_write_sees_each_record_once",
    ],
)
def test_a_store_that_pages_by_timestamp_fails_the_paging_tests(test: str) -> None:
    with pytest.raises(AssertionError):
        run(BY_CLOCK, test)


def test_the_suite_fails_through_pytest_too(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """Collected by pytest from a user's test file, the suite reports the
    broken store's failures (and nothing else fails for it)."""
    import os

    monkeypatch.setenv("PYTHONPATH", os.path.dirname(__file__) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    pytester.makepyfile(
        test_user="""
from agentstate_rs.testing import StateStoreConformance
from pystore import PyStateStore

class TestUnscrubbed(StateStoreConformance):
    def make_store(self):
        return PyStateStore(self.clock, scrub=False)
"""
    )
    result = pytester.runpytest_subprocess("-q", "-k", "x1 or r1_ or r2_stale")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*test_x1_tool_call_arguments_are_scrubbed_on_write*"])
