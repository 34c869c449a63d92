"""The platform's settings as the tests run them: the deployment's (DEBUG off), with a secret key of their own,
since a platform without LOOM_SECRET_KEY refuses to start."""

import os

os.environ.setdefault("LOOM_SECRET_KEY", "loom-tests-only-" + "k" * 40)
# Most platform tests play a run's ranks themselves (16, 64, up to 1,024) and never start them; this host's
# CPU rank slots (4 per core) would refuse such runs. The runs that really train stay within 8 ranks, and
# tests/platform/test_launch_limits.py sets the slots it checks.
os.environ.setdefault("LOOM_LOCAL_CPU_SLOTS", "4096")

from loom.settings import *  # noqa: E402, F403
