"""``python -m sarathi_pp``: the same as the ``sarathi-pp`` command."""

import sys

from sarathi_pp.cli import main

sys.exit(main())
