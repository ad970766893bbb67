"""Two tiers of one suite.

    python -m pytest -q              # the quick tier: every strategy against torch, in minutes
    python -m pytest -q -m slow      # the full grid's remainder (CI runs it after the quick tier)
    python -m pytest -q --full       # both tiers in one call

A test marked `slow` is left out of a plain run: world 4, every model and
every precision × strategy × feature, DeepSpeed parity, the soak. A `-m`
expression of your own picks tests as pytest's `-m` always does.
"""
import pytest


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="run the slow tier too (tests marked slow), as CI does")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: the full grid's cases, left out of a plain run (--full or -m slow)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full") or config.option.markexpr:
        return
    quick = [item for item in items if item.get_closest_marker("slow") is None]
    if len(quick) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("slow")])
        items[:] = quick
