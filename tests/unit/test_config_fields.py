"""What every section shares (trainers.config.fields): references checked without importing them
where nothing may run, options kept small."""

from __future__ import annotations

import pytest

from trainers.config.errors import SpecError
from trainers.config.loading import validate


def test_the_service_validates_without_importing_what_a_spec_names(tmp_path, monkeypatch):
    from trainers.config.fields import refs_not_imported

    marker = tmp_path / "imported"
    (tmp_path / "sideeffect_mod.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef make(): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = {"model": {"factory": "sideeffect_mod:make"}, "data": {"factory": "sideeffect_mod:make"}}
    with refs_not_imported():
        validate(spec)
        with pytest.raises(SpecError, match="must look like 'package.module:function'"):
            validate({"train_loop": "not a ref"})
    assert not marker.exists()
    validate(spec)  # outside the block (etrain run): imported, so a typo fails before anything starts
    assert marker.exists()


def test_options_are_small_plain_data():
    deep: dict = {"v": 1}
    for _ in range(7):
        deep = {"d": deep}
    with pytest.raises(SpecError) as err:
        validate({"model": {"options": deep}})
    assert err.value.problems[0].startswith("model.options: {") and "}: nested 9 levels deep: options are at most 6 " \
        "levels: flatten them" in err.value.problems[0]
    with pytest.raises(SpecError) as err:
        validate({"data": {"options": {"rows": list(range(5000))}}})
    assert "data.options: {...}:" in err.value.problems[0] and "options hold at most 16384 bytes" in err.value.problems[0]
    assert validate({"model": {"options": {"a": {"b": [1, 2, {"c": "x"}]}}}}).model.options["a"]["b"][2] == {"c": "x"}
