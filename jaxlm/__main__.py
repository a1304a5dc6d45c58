"""`python -m jaxlm`: the same command line as `jaxlm`."""

import sys

from jaxlm.cli import main

sys.exit(main())
