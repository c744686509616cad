"""Structured-output workload: N JSON schemas (nested objects, enums, arrays, bounded numbers) x M
chat prompts, shared by bench/structured.py and the slow end-to-end test (tests/grammar)."""

from __future__ import annotations

from typing import Any

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "maxLength": 24},
        },
        "required": ["name", "age", "city"],
    },
    "product": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 32},
            "category": {"enum": ["book", "food", "toy", "tool"]},
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
        },
        "required": ["title", "category", "price", "tags"],
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 99999},
            "paid": {"type": "boolean"},
            "customer": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 24},
                               "tier": {"enum": ["gold", "silver", "basic"]}},
                "required": ["name", "tier"],
            },
            "items": {
                "type": "array",
                "items": {"type": "object",
                          "properties": {"sku": {"type": "string", "maxLength": 10},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                          "required": ["sku", "qty"]},
                "minItems": 1, "maxItems": 2,
            },
        },
        "required": ["id", "paid", "customer", "items"],
    },
}

PROMPTS = [
    "Answer in JSON. Make up an example {kind} record.",
    "Return one {kind} as a JSON object, nothing else.",
    "Describe a typical {kind} in JSON.",
]


def chat_messages(kind: str, prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt.format(kind=kind)}]
