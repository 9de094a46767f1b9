"""``python -m matrix_owner_optim`` (and ``torchrun -m matrix_owner_optim``): the command line."""

import sys

from .toolbox.cli.main import main

sys.exit(main())
