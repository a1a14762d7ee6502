"""``python -m zero_offload.cli`` runs the ``zero-offload`` command, as it did when the CLI
was one module."""

import sys

from .command import main

sys.exit(main())
