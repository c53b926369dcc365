"""Suite-wide settings.

Hypothesis runs derandomized by default (profile "ci"): a fresh clone draws the same examples
every time, so CI cannot turn red without a code change. `HYPOTHESIS_PROFILE=dev` (make
test-random) explores new examples, as a developer should before landing a property.
"""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
