"""The test suite (a package, so shared helpers import as `from tests.helpers import ...`)."""
