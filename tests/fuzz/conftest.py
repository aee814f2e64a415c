"""Hypothesis settings of the fuzz tests, and the child process they run their cases in.

The `ci` profile (the default) is derandomized and keeps no example database, so CI runs the
same bounded set of cases every time; `CUVIL_FUZZ_SCALE=10 HYPOTHESIS_PROFILE=explore` runs
ten times as many fresh random cases when hunting for new defects.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from fuzz_worker import Worker
from hypothesis import HealthCheck, settings

settings.register_profile("ci", deadline=None, derandomize=True, database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", deadline=None, derandomize=False, database=None,
                          print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

#: multiplies every fuzz test's max_examples
SCALE = float(os.environ.get("CUVIL_FUZZ_SCALE", "1"))


def budget(examples: int) -> int:
    return max(1, int(examples * SCALE))


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    w = Worker()
    yield w
    w.close()
