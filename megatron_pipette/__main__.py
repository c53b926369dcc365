"""`python -m megatron_pipette ...` is `pipette ...` (for machines where the console script is not installed)."""

import sys

from megatron_pipette.cli.main import main

sys.exit(main())
