"""The simulator's batch settlement: the billing view shows bills up to the last batch boundary."""

from __future__ import annotations

from quotawrap.simulator import BillRecord, PackageSpec
from quotawrap.simulator._billing import report_packages, settled_until


class TestSettledUntil:
    def test_without_batches_it_is_the_plain_delay(self) -> None:
        """settle_every 0: now - delay, as before."""
        assert settled_until(1_000.0, 300.0) == 700.0

    def test_batches_round_down_to_a_boundary(self) -> None:
        """Every 900 s, 300 s after the fact: the lag saws between 300 and 1200 s."""
        assert settled_until(1_500.0, 300.0, 900.0) == 900.0
        assert settled_until(2_099.0, 300.0, 900.0) == 900.0
        assert settled_until(2_100.0, 300.0, 900.0) == 1_800.0


def test_report_packages_shows_only_settled_batches() -> None:
    """A bill after the last boundary is not yet drawn from the package in the billing view."""
    spec = PackageSpec("m", 1_000, 0.0, 10_000.0)
    bills = [BillRecord(100.0, "m", "/chat", 10, 90), BillRecord(1_000.0, "m", "/chat", 0, 200)]
    (item,) = report_packages([spec], bills, 1_500.0, 300.0, 900.0)
    assert item["AvailableAmount"] == "900"  # only the bill at 100 s is settled by the 900 s batch
    (item,) = report_packages([spec], bills, 1_500.0, 300.0)
    assert item["AvailableAmount"] == "700"  # without batches both are visible
