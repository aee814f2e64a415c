"""The assertion every fuzz test makes on a task's outcome (see fuzz_tasks.py)."""

from __future__ import annotations

from typing import Any

import pytest
from fuzz_worker import Worker, WorkerDied
from hypothesis import event
from hypothesis.control import currently_in_test_context


def check(worker: Worker, task: str, *args: Any) -> tuple[str, Any]:
    """Run the task in the child; fail on a crash, a hang or an outcome "bug"."""
    try:
        outcome, detail = worker.run(task, *args)
    except WorkerDied as exc:
        pytest.fail(str(exc))
    if currently_in_test_context():  # counted in --hypothesis-show-statistics
        event(outcome)
        if outcome == "ort-refuses":
            event(f"onnxruntime refuses, cuvil compiles: {str(detail)[:120]}")
    assert outcome != "bug", detail
    return outcome, detail
