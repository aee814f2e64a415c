"""Shared test set-up: make `tests/oracle.py` importable from every test folder, and check
the IR's invariants on the frontend's output and after every pass in every test (xdist
workers inherit the variable)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("CUVIL_VERIFY_IR", "1")
