"""Paths shared by the tests (tests/ is on sys.path; the repo root deliberately is not)."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
CLI = str(Path(sys.executable).with_name("osdp-platform"))
