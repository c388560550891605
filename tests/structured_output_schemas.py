"""Twenty JSON schemas for the structured-output tests: each with a request a user might make."""

from __future__ import annotations

_STR = {"type": "string", "maxLength": 24}

SCHEMAS: list[tuple[str, dict]] = [
    ("a person", {
        "type": "object",
        "properties": {"name": _STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"]}),
    ("a list of three fruits", {
        "type": "array", "items": _STR, "minItems": 3, "maxItems": 3}),
    ("a traffic light state", {
        "type": "object",
        "properties": {"color": {"enum": ["red", "yellow", "green"]},
                       "seconds_left": {"type": "integer", "minimum": 0, "maximum": 90}},
        "required": ["color", "seconds_left"]}),
    ("a book with its author", {
        "type": "object",
        "properties": {
            "title": _STR,
            "author": {"type": "object",
                       "properties": {"first": _STR, "last": _STR, "born": {"type": "integer"}},
                       "required": ["first", "last"]},
            "year": {"type": "integer", "minimum": 1400, "maximum": 2030}},
        "required": ["title", "author"]}),
    ("a temperature reading", {
        "type": "object",
        "properties": {"celsius": {"type": "number", "minimum": -90, "maximum": 60},
                       "city": _STR},
        "required": ["celsius", "city"]}),
    ("a yes/no answer with a confidence", {
        "type": "object",
        "properties": {"answer": {"type": "boolean"},
                       "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["answer", "confidence"]}),
    ("a shopping cart", {
        "type": "object",
        "properties": {"items": {
            "type": "array", "maxItems": 3,
            "items": {"type": "object",
                      "properties": {"sku": _STR,
                                     "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                      "required": ["sku", "qty"]}}},
        "required": ["items"]}),
    ("an RGB color", {
        "type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 255}] * 3,
        "items": False, "minItems": 3}),
    ("a user profile with optional fields", {
        "type": "object",
        "properties": {"username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,11}$"},
                       "email": _STR, "verified": {"type": "boolean"},
                       "followers": {"type": "integer", "minimum": 0}},
        "required": ["username"]}),
    ("a weekday", {"enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday",
                            "Saturday", "Sunday"]}),
    ("a point in 2D", {
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": -100, "maximum": 100},
                       "y": {"type": "integer", "minimum": -100, "maximum": 100}},
        "required": ["x", "y"]}),
    ("a movie rating", {
        "type": "object",
        "properties": {"movie": _STR, "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                       "tags": {"type": "array", "items": {"enum": ["fun", "sad", "long"]},
                                "maxItems": 3}},
        "required": ["movie", "stars", "tags"]}),
    ("an HTTP response summary", {
        "type": "object",
        "properties": {"status": {"enum": [200, 201, 404, 500]},
                       "ok": {"type": "boolean"},
                       "headers": {"type": "object",
                                   "properties": {"content_type": _STR},
                                   "required": ["content_type"]}},
        "required": ["status", "ok", "headers"]}),
    ("a matrix of small numbers", {
        "type": "array", "minItems": 2, "maxItems": 2,
        "items": {"type": "array", "minItems": 2, "maxItems": 2,
                  "items": {"type": "integer", "minimum": 0, "maximum": 9}}}),
    ("a nullable nickname", {
        "type": "object",
        "properties": {"name": _STR, "nickname": {"type": ["string", "null"], "maxLength": 12}},
        "required": ["name", "nickname"]}),
    ("a country and its capital", {
        "type": "object",
        "properties": {"country": _STR, "capital": _STR,
                       "population_millions": {"type": "number", "minimum": 0,
                                               "maximum": 2000}},
        "required": ["country", "capital"]}),
    ("a calendar event", {
        "type": "object",
        "properties": {"title": _STR,
                       "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                       "all_day": {"type": "boolean"}},
        "required": ["title", "date", "all_day"]}),
    ("a pet", {
        "type": "object",
        "properties": {"species": {"enum": ["cat", "dog", "bird"]}, "name": _STR,
                       "age_years": {"type": "integer", "minimum": 0, "maximum": 30}},
        "required": ["species", "name"]}),
    ("a score between 0 and 10", {"type": "integer", "minimum": 0, "maximum": 10}),
    ("an order with a shipping address", {
        "type": "object",
        "properties": {
            "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
            "address": {"type": "object",
                        "properties": {"street": _STR, "zip": {"type": "string",
                                                               "pattern": "^[0-9]{5}$"}},
                        "required": ["street", "zip"]},
            "express": {"type": "boolean"}},
        "required": ["order_id", "address"]}),
]
