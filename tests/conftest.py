"""Shared test set-up: make `tests/oracle.py` importable from every test folder."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
