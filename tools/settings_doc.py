"""Rewrite the settings table of docs/settings.md from pantheon.config.SETTINGS.

Run after adding or changing a row: `python tools/settings_doc.py` (`--check` only reports whether the
page is current, exit 1 when not). tests/test_settings.py fails while the page and the table differ, so
the page cannot drift; the prose around the table is written by hand and left as it is.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from a checkout: use this checkout's pantheon
    sys.path.insert(0, str(REPO))

from pantheon.config import TABLE_BEGIN, TABLE_END, settings_table_markdown  # noqa: E402

PAGE = REPO / "docs" / "settings.md"


def with_current_table(page: str) -> str:
    """`page` with the text between the two marker lines replaced by the generated table."""
    head, begin, rest = page.partition(TABLE_BEGIN + "\n")
    _, end, tail = rest.partition(TABLE_END)
    if not begin or not end:
        raise ValueError(f"{PAGE} lacks the marker lines {TABLE_BEGIN!r} ... {TABLE_END!r}")
    return head + begin + settings_table_markdown() + end + tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only report whether docs/settings.md is current")
    args = ap.parse_args(argv)
    page = PAGE.read_text()
    current = with_current_table(page)
    if args.check:
        if current != page:
            print(f"{PAGE} is out of date: run python tools/settings_doc.py", file=sys.stderr)
            return 1
        return 0
    if current != page:
        PAGE.write_text(current)
        print(f"rewrote the table of {PAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
