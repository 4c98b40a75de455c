"""``python -m pdserve ...`` is the ``pdserve`` command line."""
from __future__ import annotations

import sys

from pdserve.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
