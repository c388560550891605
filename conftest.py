"""The test suite's shared fixtures for the tests of the distributions under schedulers/ and
plugins/ (tests/ has its own conftest, which these come from)."""

from tests.conftest import tiny_llama, tiny_models  # noqa: F401
