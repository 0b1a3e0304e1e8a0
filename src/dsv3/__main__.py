"""`python -m dsv3` is the `dsv3` command."""

import sys

from dsv3.cli import main

sys.exit(main())
