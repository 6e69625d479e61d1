"""`make test`'s file order: the longest files first, in the conftest's order, and xdist told to keep it."""
from __future__ import annotations

import os
import re
from types import SimpleNamespace

from tests import conftest

_TESTS = os.path.join(conftest._ROOT, "tests")


def test_every_longest_first_file_exists():
    # A renamed or removed file would silently fall back to the collection order.
    missing = [f for f in conftest._LONGEST_FIRST if not os.path.isfile(os.path.join(_TESTS, f))]
    assert not missing, missing
    assert len(set(conftest._LONGEST_FIRST)) == len(conftest._LONGEST_FIRST)


def test_collection_puts_the_longest_files_first_in_their_order():
    first, second = conftest._LONGEST_FIRST[:2]
    names = ["tests/unit/test_a.py::t1", f"tests/{second}::t2", "tests/integration/test_b.py::t3",
             f"tests/{first}::t4", f"tests/{second}::t5", "tests/unit/test_a.py::t6"]
    items = [SimpleNamespace(nodeid=n, get_closest_marker=lambda name: None) for n in names]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == [names[3], names[1], names[4], names[0], names[2], names[5]]


def test_make_test_keeps_the_collection_order():
    # xdist's default (--loadscope-reorder) sorts files by their number of tests, which undoes the order above.
    makefile = open(os.path.join(conftest._ROOT, "Makefile")).read()
    recipe = re.search(r"^test:.*\n\t(.*)$", makefile, re.M).group(1)
    assert "--dist loadfile" in recipe and "--no-loadscope-reorder" in recipe, recipe
