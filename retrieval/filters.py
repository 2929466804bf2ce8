"""Document attributes and the filters over them (OpenAI's vector-store filter shape), compiled to SQL once.

Attributes: at most ``MAX_ATTRIBUTES`` keys per document, a key 1-64 characters, a value a string (at most
``MAX_STRING_CHARS``), a finite number or a boolean. They are rows of the catalogue's ``document_attributes``
(one per key, the value in a column of its kind), so a filter is evaluated by the database, the same way on SQLite
and PostgreSQL, and the search only ever sees the set of documents that match.

A filter is ``{"type": "eq"|"ne"|"gt"|"gte"|"lt"|"lte"|"in"|"nin", "key", "value"}`` or
``{"type": "and"|"or", "filters": [...]}``, nested. Meaning (tested on both databases):

- every comparison needs the key: a document without it matches none of them, ``ne`` and ``nin`` included (a key
  no document has matches nothing);
- values compare within their kind: the string "1" is not the number 1, ``true`` is not 1;
- ``gt`` / ``gte`` / ``lt`` / ``lte`` take a number or a string (strings by code point: ISO dates order), never a
  boolean; ``in`` / ``nin`` take a non-empty list of scalars; ``eq`` / ``ne`` take a scalar.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import sqlalchemy as sa

from retrieval.errors import InvalidAttributes, InvalidFilter

Scalar = str | float | bool
Attributes = dict[str, Scalar]
Kind = Literal["s", "n", "b"]

MAX_ATTRIBUTES = 16
MAX_KEY_CHARS = 64
MAX_STRING_CHARS = 512
MAX_FILTER_DEPTH = 8
MAX_FILTER_TERMS = 64  # comparisons in one filter
MAX_IN_VALUES = 256

COMPARISONS = ("eq", "ne", "gt", "gte", "lt", "lte", "in", "nin")
COMPOUNDS = ("and", "or")


@dataclass(frozen=True)
class Comparison:
    op: str
    key: str
    value: Scalar | tuple[Scalar, ...]


@dataclass(frozen=True)
class Compound:
    op: str
    filters: tuple[Filter, ...]


Filter = Comparison | Compound


def kind_of(value: Scalar) -> Kind:
    """The column a value lives in: booleans before numbers (``True`` is an int in Python)."""
    if isinstance(value, bool):
        return "b"
    return "n" if isinstance(value, int | float) else "s"


def _scalar(value: Any) -> bool:
    return isinstance(value, str | bool) or (isinstance(value, int | float) and math.isfinite(value))


# ---- attributes -----------------------------------------------------------------------------------


def check_attributes(attributes: Any) -> Attributes:
    """Validated attributes (numbers as floats), or ``InvalidAttributes`` naming the first fault."""
    if not isinstance(attributes, Mapping):
        raise InvalidAttributes(f"attributes: must be a JSON object, got {type(attributes).__name__}")
    if len(attributes) > MAX_ATTRIBUTES:
        raise InvalidAttributes(f"attributes: {len(attributes)} keys, at most {MAX_ATTRIBUTES} allowed")
    out: Attributes = {}
    for key, value in attributes.items():
        if not isinstance(key, str) or not 1 <= len(key) <= MAX_KEY_CHARS:
            raise InvalidAttributes(f"attributes: a key must be 1-{MAX_KEY_CHARS} characters, got {str(key)[:80]!r}")
        if not _scalar(value):
            raise InvalidAttributes(f"attributes.{key}: must be a string, a finite number or a boolean, "
                                    f"got {type(value).__name__ if value is not None else 'null'}")
        if isinstance(value, str) and len(value) > MAX_STRING_CHARS:
            raise InvalidAttributes(f"attributes.{key}: {len(value)} characters, at most {MAX_STRING_CHARS} allowed")
        out[key] = value if isinstance(value, str | bool) else float(value)
    return out


def attribute_row(doc_id: str, key: str, value: Scalar) -> dict[str, Any]:
    """The ``document_attributes`` row of one attribute."""
    kind = kind_of(value)
    return {"doc_id": doc_id, "key": key, "kind": kind, "text_value": value if kind == "s" else None,
            "num_value": None if kind == "s" else float(value)}


def attribute_value(kind: str, text_value: str | None, num_value: float | None) -> Scalar:
    """An attribute read back from its row: integral numbers as ints, as they were most likely sent."""
    if kind == "s":
        return text_value or ""
    if kind == "b":
        return bool(num_value)
    assert num_value is not None
    return int(num_value) if num_value.is_integer() and abs(num_value) < 2**53 else num_value


# ---- parsing --------------------------------------------------------------------------------------


def parse_filter(raw: Any, where: str = "filter") -> Filter:
    """A filter from its JSON form, or ``InvalidFilter`` naming the place at fault."""
    counter = [0]
    return _parse(raw, where, 1, counter)


def _parse(raw: Any, where: str, depth: int, counter: list[int]) -> Filter:
    if not isinstance(raw, Mapping):
        raise InvalidFilter(f"{where}: must be an object, got {type(raw).__name__ if raw is not None else 'null'}")
    op = raw.get("type")
    if op in COMPOUNDS:
        _only(raw, ("type", "filters"), where)
        if depth >= MAX_FILTER_DEPTH:
            raise InvalidFilter(f"{where}: filters nest at most {MAX_FILTER_DEPTH} levels deep")
        filters = raw.get("filters")
        if not isinstance(filters, list) or not filters:
            raise InvalidFilter(f"{where}.filters: a compound filter needs a non-empty list of filters")
        return Compound(op, tuple(_parse(f, f"{where}.filters[{i}]", depth + 1, counter)
                                  for i, f in enumerate(filters)))
    if op not in COMPARISONS:
        raise InvalidFilter(f"{where}.type: {op!r} is not an operator; use one of "
                            f"{', '.join(COMPARISONS + COMPOUNDS)}")
    _only(raw, ("type", "key", "value"), where)
    counter[0] += 1
    if counter[0] > MAX_FILTER_TERMS:
        raise InvalidFilter(f"{where}: at most {MAX_FILTER_TERMS} comparisons in one filter")
    key = raw.get("key")
    if not isinstance(key, str) or not 1 <= len(key) <= MAX_KEY_CHARS:
        raise InvalidFilter(f"{where}.key: must be a string of 1-{MAX_KEY_CHARS} characters")
    if "value" not in raw:
        raise InvalidFilter(f"{where}.value: missing")
    value = raw["value"]
    if op in ("in", "nin"):
        if not isinstance(value, list) or not value:
            raise InvalidFilter(f"{where}.value: {op} needs a non-empty list of strings, numbers or booleans")
        if len(value) > MAX_IN_VALUES:
            raise InvalidFilter(f"{where}.value: at most {MAX_IN_VALUES} values")
        for i, v in enumerate(value):
            if not _scalar(v):
                raise InvalidFilter(f"{where}.value[{i}]: must be a string, a finite number or a boolean")
        return Comparison(op, key, tuple(value))
    if not _scalar(value):
        shape = "a list" if isinstance(value, list) else type(value).__name__ if value is not None else "null"
        raise InvalidFilter(f"{where}.value: {op} needs a string, a finite number or a boolean, got {shape}")
    if op in ("gt", "gte", "lt", "lte") and isinstance(value, bool):
        raise InvalidFilter(f"{where}.value: {op} compares numbers or strings, not booleans")
    return Comparison(op, key, value)


def _only(raw: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    extra = sorted(set(raw) - set(allowed))
    if extra:
        raise InvalidFilter(f"{where}: unknown field {extra[0]!r} (a {raw.get('type')} filter has "
                            f"{', '.join(allowed)})")


# ---- SQL ------------------------------------------------------------------------------------------


def to_sql(f: Filter, attributes: sa.Table, doc_id: sa.ColumnElement[Any]) -> sa.ColumnElement[bool]:
    """The filter as a condition on ``doc_id`` (a documents column): ``EXISTS`` over its attribute rows."""
    if isinstance(f, Compound):
        parts = [to_sql(g, attributes, doc_id) for g in f.filters]
        return sa.and_(*parts) if f.op == "and" else sa.or_(*parts)
    a = attributes.c
    if f.op in ("in", "nin"):
        assert isinstance(f.value, tuple)
        condition = _member(a, f.value)
        if f.op == "nin":
            condition = sa.not_(condition)
    else:
        assert not isinstance(f.value, tuple)
        condition = _compare(a, f.op, f.value)
    return sa.exists().where(a.doc_id == doc_id, a.key == f.key, condition)


def _column(a: Any, value: Scalar) -> Any:
    return a.text_value if kind_of(value) == "s" else a.num_value


def _sql_value(value: Scalar) -> str | float:
    return value if isinstance(value, str) else float(value)


def _compare(a: Any, op: str, value: Scalar) -> Any:
    same_kind = a.kind == kind_of(value)
    col, v = _column(a, value), _sql_value(value)
    if op == "eq":
        return sa.and_(same_kind, col == v)
    if op == "ne":
        return sa.not_(sa.and_(same_kind, col == v))
    compare = {"gt": col > v, "gte": col >= v, "lt": col < v, "lte": col <= v}[op]
    return sa.and_(same_kind, compare)


def _member(a: Any, values: tuple[Scalar, ...]) -> Any:
    parts = []
    for kind in ("s", "n", "b"):
        of_kind = [_sql_value(v) for v in values if kind_of(v) == kind]
        if of_kind:
            col = a.text_value if kind == "s" else a.num_value
            parts.append(sa.and_(a.kind == kind, col.in_(of_kind)))
    return sa.or_(*parts)
