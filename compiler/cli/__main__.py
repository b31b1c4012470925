"""`python -m zlc.cli ...`: the same as the `zlc` console script (tests and benches run it so)."""

from __future__ import annotations

from . import main

if __name__ == "__main__":  # pragma: no cover
    main()
