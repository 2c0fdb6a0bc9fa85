"""A suite of JSON schemas for constrained decoding: what the grammar-library measurement
(`python -m collm_bench engine grammar-libs`) and the structured-output tests run. Each covers a feature
clients use in `response_format: {"type": "json_schema"}` and tool parameters: nested objects, enums,
arrays with bounds, optional and required properties, numbers, integers, booleans, null, string lengths
and patterns, `anyOf`, `$ref` definitions and constants."""

from __future__ import annotations

from typing import Any

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat_object": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "booleans_and_null": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "reason": {"type": "null"}},
        "required": ["ok", "reason"],
        "additionalProperties": False,
    },
    "number_bounds": {
        "type": "object",
        "properties": {
            "temperature_c": {"type": "number", "minimum": -50, "maximum": 60},
            "count": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["temperature_c", "count"],
        "additionalProperties": False,
    },
    "string_enum": {
        "type": "object",
        "properties": {"sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]}},
        "required": ["sentiment"],
        "additionalProperties": False,
    },
    "top_level_enum": {"enum": ["red", "green", "blue"]},
    "mixed_enum": {"enum": ["a", 1, True, None]},
    "const": {
        "type": "object",
        "properties": {"version": {"const": 2}, "kind": {"const": "report"}},
        "required": ["version", "kind"],
        "additionalProperties": False,
    },
    "array_of_strings": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    "array_bounds": {
        "type": "object",
        "properties": {
            "scores": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}
        },
        "required": ["scores"],
        "additionalProperties": False,
    },
    "nested_object": {
        "type": "object",
        "properties": {
            "patient": {
                "type": "object",
                "properties": {
                    "id": {"type": "string", "maxLength": 10},
                    "vitals": {
                        "type": "object",
                        "properties": {"hr": {"type": "integer"}, "spo2": {"type": "number"}},
                        "required": ["hr", "spo2"],
                        "additionalProperties": False,
                    },
                },
                "required": ["id", "vitals"],
                "additionalProperties": False,
            }
        },
        "required": ["patient"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string", "maxLength": 8}, "qty": {"type": "integer"}},
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    "optional_properties": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 20},
            "subtitle": {"type": "string", "maxLength": 20},
            "pages": {"type": "integer"},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
    "string_length": {
        "type": "object",
        "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 5}},
        "required": ["code"],
        "additionalProperties": False,
    },
    "string_pattern": {
        "type": "object",
        "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
        "required": ["date"],
        "additionalProperties": False,
    },
    "any_of": {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 6}]}},
        "required": ["value"],
        "additionalProperties": False,
    },
    "nullable": {
        "type": "object",
        "properties": {"email": {"type": ["string", "null"], "maxLength": 20}},
        "required": ["email"],
        "additionalProperties": False,
    },
    "definitions_ref": {
        "type": "object",
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    "enum_array": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["urgent", "billing", "tech"]}, "maxItems": 3}
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "deep_nesting": {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"c": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}},
                        "required": ["c"],
                        "additionalProperties": False,
                    }
                },
                "required": ["b"],
                "additionalProperties": False,
            }
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    "tool_call_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "medical_triage": {
        "type": "object",
        "properties": {
            "severity": {"type": "integer", "minimum": 1, "maximum": 5},
            "department": {"enum": ["cardiology", "neurology", "general"]},
            "symptoms": {"type": "array", "items": {"type": "string", "maxLength": 15}, "maxItems": 3},
            "admit": {"type": "boolean"},
        },
        "required": ["severity", "department", "symptoms", "admit"],
        "additionalProperties": False,
    },
    "bounded_map": {
        "type": "object",
        "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 99},
        "propertyNames": {"maxLength": 6},
        "maxProperties": 3,
    },
}
