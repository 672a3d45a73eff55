"""``python -m tierstore``: the same as the ``tierstore`` command."""

import sys

from tierstore.admin.cli import main

sys.exit(main())
