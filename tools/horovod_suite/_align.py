"""A pytest plugin of the runner: ranks meet at the start of every test of Horovod's suite.

Some of Horovod's tests can fail on some ranks only (a rank-dependent assertion, as in
`test_horovod_reducescatter_prescale` at 3 ranks); the ranks that did not fail go on calling
collectives that the failed rank never joins, and every later test would meet the wrong calls.
So, before each test, every rank makes one small allreduce whose tree is this plugin's own (so it
never pairs with a test's call): it carries the test's position. A rank that meets a test's
collective instead (`CollectiveMismatchError`: the others are still in an earlier test) tries
again until they arrive; a rank that is behind fails its current test at once ("out of step") and
moves on. Tests thus start together, and a failure stays the failure of the test it happened in.
Nothing is done in a world of one, or while dataparallel is not initialized (between Gloo
tests, whose tearDown shuts it down).
"""

from __future__ import annotations

import numpy as np
import pytest

import dataparallel as dp

_TRIES = 10_000  # each failed try costs the other ranks one mismatched call


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if not dp.initialized() or dp.size() == 1:
        return
    position = item.session.items.index(item)
    for _ in range(_TRIES):
        try:
            bounds = dp.allreduce(
                {"horovod suite: start of test": np.array([position, -position], np.int64)},
                op="max",
            )["horovod suite: start of test"]
        except dp.CollectiveMismatchError:
            continue  # another rank is still in a test: it will fail there and come here
        if position < bounds[0]:
            pytest.fail(
                f"out of step: another rank is at test {bounds[0]} already (an earlier test "
                "failed on some ranks only)",
                pytrace=False,
            )
        if -bounds[1] == position:
            return  # every rank is here
    pytest.fail("the ranks could not meet at the start of this test", pytrace=False)
