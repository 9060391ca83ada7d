"""BENCHMARKS.md holds the current tables only: past runs, before / after evaluations and investigation notes go to
docs/benchmarks-history.md, so the file a user reads stays short."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 300


def test_benchmarks_md_stays_short():
    lines = (ROOT / "BENCHMARKS.md").read_text().splitlines()
    assert len(lines) <= MAX_LINES, (
        f"BENCHMARKS.md has {len(lines)} lines (at most {MAX_LINES}): move superseded runs, before / after "
        "evaluations and notes to docs/benchmarks-history.md"
    )


def test_benchmarks_history_exists():
    assert (ROOT / "docs" / "benchmarks-history.md").is_file()
