"""The lab's tests (benchmarks, the demo): fixtures shared with the product's tests."""

from tests.support.fake_http import fakes

__all__ = ["fakes"]  # the fixture, for the serving benchmark's tests
