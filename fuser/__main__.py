"""``python -m fuser``: the ``fuser`` command."""

import sys

from fuser.cli import main

sys.exit(main())
