from tests.helpers import one_thread  # noqa: F401  (every kernel test on one torch thread)
