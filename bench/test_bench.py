"""Every timed bench case under pytest-benchmark; see bench/conftest.py."""

import importlib

import pytest

from bench import _harness
from bench.__main__ import SUITES


def _cases():
    config = _harness.Config(quick=True)
    for suite in SUITES:
        for case in importlib.import_module(f"bench.{suite}").cases(config):
            if case.fn is not None:
                yield pytest.param(case, id=f"{suite}/{case.name}")


@pytest.mark.parametrize("case", list(_cases()))
def test_case(benchmark, case):
    if case.check is not None:
        case.check()
    benchmark(case.fn)
