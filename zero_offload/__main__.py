"""``python -m zero_offload`` runs the ``zero-offload`` command."""

import sys

from .cli import main

sys.exit(main())
