"""The HPCRING_* registry: parsing, errors naming the variable, docs and code in step with it."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from hpcring.config import envvars
from hpcring.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]


def test_docs_table_is_generated_from_the_registry():
    doc = (ROOT / "docs/environment.md").read_text()
    assert envvars.render_doc(doc) == doc, "run: python -m hpcring.config.envvars docs/environment.md"
    for v in envvars.VARS:
        assert f"| `{v.name}` |" in doc


def test_every_variable_named_in_the_code_is_registered():
    names = set()
    for path in list((ROOT / "src/hpcring").rglob("*.py")) + list((ROOT / "templates").rglob("*.j2")):
        names |= set(re.findall(r"\bHPCRING_[A-Z][A-Z0-9_]*", path.read_text()))
    unknown = sorted(names - set(envvars.REGISTRY))
    assert not unknown, f"add these to hpcring.config.envvars.VARS: {unknown}"


def test_defaults_and_values():
    assert envvars.get("HPCRING_TIMEOUT", {}) == envvars.DEFAULT_TIMEOUT == 300.0
    assert envvars.get("HPCRING_TIMEOUT", {"HPCRING_TIMEOUT": " 8 "}) == 8.0
    assert envvars.get("HPCRING_TIMEOUT", {"HPCRING_TIMEOUT": ""}) == 300.0
    assert envvars.get("HPCRING_STORE_PORT", {"HPCRING_STORE_PORT": "29501"}) == 29501
    assert envvars.get("HPCRING_WATCHDOG", {"HPCRING_WATCHDOG": "Off"}) is False
    assert envvars.get("HPCRING_BACKEND", {"HPCRING_BACKEND": "MPI"}) == "mpi"


def test_error_names_variable_value_bounds_and_remedy():
    with pytest.raises(UsageError) as exc:
        envvars.get("HPCRING_TIMEOUT", {"HPCRING_TIMEOUT": "nan"})
    text = str(exc.value)
    assert "HPCRING_TIMEOUT='nan'" in text and "finite" in text and "unset HPCRING_TIMEOUT" in text


def test_check_number():
    assert envvars.check_number("--x", "3", lo=1, integer=True) == 3
    for bad in (float("nan"), float("inf"), "x", 0, True, None):
        with pytest.raises(UsageError, match="--x"):
            envvars.check_number("--x", bad, lo=0, lo_open=True)


def test_each_variable_is_registered_once():
    names = [v.name for v in envvars.VARS]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []


@pytest.mark.parametrize("bad", ["a\nb", "a\x1b[31m", "a\x85b", "a\u2028b", "a\u202eb", "a\x7f"])
def test_variables_refuse_what_site_values_refuse(bad):
    """One definition of a control character (hpcring.config.text) for variables and site values:
    C1 controls, line separators and bidi overrides too, not only ASCII's."""
    from hpcring.config.text import check_text, text_problem
    assert text_problem(bad)
    with pytest.raises(ValueError, match="control character"):
        check_text(bad)
