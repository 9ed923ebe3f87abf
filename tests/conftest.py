"""Shared test setup.

Eight fake CPU devices let sharding tests run on any machine; the flag must be set
before JAX initialises its backends, hence here, at collection time.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
