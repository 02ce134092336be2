"""The installed packages satisfy pyproject.toml's floors and ceilings, so CI proves the ranges it runs on.

Faults caught: a dependency installed outside its declared range (the ranges drifted from what CI
tests), a dependency declared without a floor or a ceiling. Cannot catch: a version inside the range
that behaves differently (only the tests run against the installed one).
"""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def requirements() -> list[Requirement]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    return [Requirement(r) for r in project["dependencies"]]


@pytest.mark.parametrize("req", requirements(), ids=lambda r: r.name)
def test_installed_version_is_inside_the_declared_range(req):
    installed = metadata.version(req.name)
    assert req.specifier.contains(installed, prereleases=True), f"{req.name} {installed} is outside {req.specifier}"


@pytest.mark.parametrize("req", requirements(), ids=lambda r: r.name)
def test_every_dependency_has_a_floor_and_a_ceiling(req):
    operators = {spec.operator for spec in req.specifier}
    assert operators & {">=", "==", "~="}, f"{req.name}: no floor"
    assert operators & {"<", "==", "~="}, f"{req.name}: no ceiling"
