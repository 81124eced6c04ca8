# The repository root is on sys.path for the tests (tests.helpers, tests.standins).
