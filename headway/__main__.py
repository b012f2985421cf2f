"""`python -m headway` is the `headway` command."""

import sys

from headway.cli import main

sys.exit(main())
