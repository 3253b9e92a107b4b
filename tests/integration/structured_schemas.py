"""Thirty small JSON schemas for the structured-output suite: nested objects, arrays with item
bounds, enums, anyOf, bounded numbers, string patterns and formats, required and optional
properties, additionalProperties false. Small on purpose (strings carry maxLength) so that a
reply from the embedded model finishes within a few dozen tokens."""

from __future__ import annotations

from typing import Any


def obj(properties: dict[str, Any], required: list[str] | None = None, **extra) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False, **extra}


def text(max_length: int = 12, **extra) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length, **extra}


SCHEMAS: list[dict[str, Any]] = [
    obj({"city": text(), "country": text()}),
    obj({"name": text(), "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    obj({"ok": {"type": "boolean"}}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"size": {"type": "string", "enum": ["S", "M", "L", "XL"]}, "count": {"type": "integer", "minimum": 1,
                                                                             "maximum": 9}}),
    obj({"tags": {"type": "array", "items": text(8), "minItems": 1, "maxItems": 3}}),
    obj({"scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                    "minItems": 2, "maxItems": 4}}),
    obj({"point": obj({"x": {"type": "number", "minimum": -10, "maximum": 10},
                       "y": {"type": "number", "minimum": -10, "maximum": 10}})}),
    obj({"user": obj({"name": text(), "address": obj({"street": text(), "zip": text(5, pattern="^[0-9]{5}$")})})}),
    obj({"price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000}}),
    obj({"temperature": {"type": "number", "minimum": -50, "maximum": 60}, "unit": {"enum": ["C", "F"]}}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}),
    obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    obj({"day": {"type": "string", "format": "date"}}),
    obj({"email": {"type": "string", "format": "email", "maxLength": 30}}),
    obj({"id": {"type": "string", "format": "uuid"}}),
    obj({"ip": {"type": "string", "format": "ipv4"}}),
    obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, text(6)]}}),
    obj({"result": {"anyOf": [obj({"ok": {"const": True}}), obj({"error": text()})]}}),
    obj({"name": text(), "nickname": text()}, required=["name"]),
    obj({"title": text(), "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
         "rating": {"type": "number", "minimum": 0, "maximum": 5}}, required=["title"]),
    obj({"items": {"type": "array", "items": obj({"name": text(8), "qty": {"type": "integer", "minimum": 1,
                                                                             "maximum": 5}}),
                   "minItems": 1, "maxItems": 2}}),
    obj({"matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9},
                                               "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}}),
    obj({"status": {"enum": ["open", "closed"]}, "priority": {"enum": [1, 2, 3]}}),
    obj({"answer": {"type": "string", "enum": ["yes", "no"]}, "confidence": {"type": "number", "minimum": 0,
                                                                              "maximum": 1}}),
    obj({"meta": obj({"version": {"type": "integer", "minimum": 1, "maximum": 9}, "beta": {"type": "boolean"}})}),
    obj({"empty": {"type": "array", "items": {"type": "integer"}, "maxItems": 0}}),
    obj({"words": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,6}$"}, "minItems": 1,
                   "maxItems": 3}}),
    obj({"note": {"type": ["string", "null"], "maxLength": 10}}),
    {"type": "object", "properties": {"kind": {"const": "event"}, "when": {"type": "string", "format": "date"},
                                      "where": text()},
     "required": ["kind", "when"], "additionalProperties": False,
     "$defs": {"unused": {"type": "string"}}},
]
