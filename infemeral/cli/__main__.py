"""`python -m infemeral.cli`: the same as `infemeral-client`."""

import sys

from infemeral.cli.main import main

sys.exit(main())
