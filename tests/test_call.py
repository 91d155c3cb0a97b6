"""The call record (:class:`rfattn.call.Call`): frozen, and its hand-written ``__init__`` takes
every field, in order, with the field's default."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from rfattn.call import Call


def test_init_takes_every_field_with_its_default():
    params = list(inspect.signature(Call).parameters.values())
    fields = dataclasses.fields(Call)
    assert [p.name for p in params] == [f.name for f in fields]
    for p, f in zip(params, fields, strict=True):
        default = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        assert p.default == default, f.name


def test_fields_are_set_frozen_and_replaceable():
    values = {f.name: object() for f in dataclasses.fields(Call)}
    call = Call(**values)
    assert all(getattr(call, n) is x for n, x in values.items())
    with pytest.raises(dataclasses.FrozenInstanceError):
        call.causal = True
    other = dataclasses.replace(call, causal=True)
    assert other.causal is True and other.q is values["q"] and call.causal is values["causal"]
    assert call == Call(**values) and call != other
