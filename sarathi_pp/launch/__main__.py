"""``python -m sarathi_pp.launch``: the same as the ``sarathi-pp`` command."""

import sys

from sarathi_pp.cli import main

sys.exit(main())
