"""The staleness gate admits exactly (i + η + 1)·B groups by version i, never one more."""

import pytest

from areal_jax.controller.gate import StalenessGate


@pytest.mark.parametrize("eta", [0, 1, 4])
def test_gate_never_admits_one_group_too_many(eta):
    B = 3
    gate = StalenessGate(batch_size=B, max_staleness=eta, max_in_flight=10_000)
    for version in range(6):
        while gate.can_submit(version):
            gate.on_submit()
        assert gate.submitted == (version + eta + 1) * B
        # The batch trained at `version` is formed from the oldest groups; each group's data is
        # at most eta versions behind: group n (0-based) is submitted at version >= n//B - eta.
        for _ in range(B):
            gate.on_finished()
        assert gate.capacity(version) == 0
    assert gate.capacity(6) == B


def test_sync_mode_is_one_batch_per_version_and_failures_free_slots():
    gate = StalenessGate(batch_size=2, max_staleness=0, max_in_flight=8)
    gate.on_submit(), gate.on_submit()
    assert not gate.can_submit(0)
    gate.on_failed()
    assert gate.capacity(0) == 1 and gate.in_flight == 1
    gate.on_submit()
    assert gate.capacity(0) == 0 and gate.capacity(1) == 2


def test_concurrency_cap_and_restore():
    gate = StalenessGate(batch_size=4, max_staleness=8, max_in_flight=5)
    for _ in range(5):
        gate.on_submit()
    assert gate.capacity(0) == 0
    gate.on_finished()
    assert gate.capacity(0) == 1
    gate.restore(version=3, pending=2)
    assert (gate.submitted, gate.in_flight) == (14, 0)
    assert gate.capacity(3) == min((3 + 8 + 1) * 4 - 14, 5)
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessGate(batch_size=1, max_staleness=-1, max_in_flight=1)
