"""Structured-output cases for the trained SmolLM2-135M-Instruct: 20 (prompt, JSON schema)
pairs and two tools, shared by ``tests/test_smollm2_openai.py`` and
``benchmarks/structured_serve.py``."""

from __future__ import annotations

S = {"type": "string"}
INT = {"type": "integer"}
NUM = {"type": "number"}
BOOL = {"type": "boolean"}
# Two of the prompts make the 135M model loop under greedy decoding until max_tokens (it
# writes "2 + 3}  #2 + 3 = 5  #2 + 3 = ...", then "result": 2018022222122322...; and
# "Espresso-Lemon-Coconut-Cream-Coconut-..."): those fields are bounded, as one does with a
# small model.
SHORT = {"type": "string", "maxLength": 24}


def _obj(required: list[str] | None = None, **props) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props),
            "additionalProperties": False}


POINT = _obj(lat=NUM, lon=NUM)
# (prompt, schema): 20 different shapes -- objects, nesting, arrays, enums, const, anyOf /
# null, $ref, patterns, bounds, top-level scalars.
CASES: list[tuple[str, dict]] = [
    ("Invent a person and give their name and age.", _obj(name=S, age=INT)),
    ("Describe today's weather in Paris.",
     _obj(city=S, temperature_c=NUM,
          condition={"enum": ["sunny", "cloudy", "rainy", "snowy"]})),
    ("What is the capital of France?", _obj(country=S, capital=S)),
    ("Is the sky blue?", _obj(answer=BOOL)),
    ("Name the three primary colors.",
     _obj(colors={"type": "array", "items": S, "minItems": 1, "maxItems": 5})),
    ("What is 2 + 3?",
     _obj(expression=SHORT, result={"type": "integer", "minimum": -999, "maximum": 999})),
    ("Recommend a classic novel.", _obj(title=S, author=S, year=INT)),
    ("Classify the sentiment of: I love this movie!",
     _obj(sentiment={"enum": ["positive", "negative", "neutral"]},
          confidence={"type": "number", "minimum": 0, "maximum": 1})),
    ("Give a simple pancake recipe.",
     _obj(dish=S, ingredients={"type": "array", "items": S, "maxItems": 6})),
    ("List the first five even numbers.",
     {"type": "array", "items": INT, "minItems": 5, "maxItems": 5}),
    ("Create a user account for Alice.", _obj(user=_obj(name=S, email=S))),
    ("When did the first moon landing happen?",
     _obj(event=S, date={"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"})),
    ("Answer yes or no: is water wet?", {"type": "string", "enum": ["yes", "no"]}),
    ("Describe a dog.",
     _obj(animal=S, legs={"type": "integer", "minimum": 0, "maximum": 100}, can_fly=BOOL)),
    ("Translate 'hello' to French.", _obj(english=S, french=S)),
    ("Invent a product for a shop.",
     _obj(name=SHORT, price={"type": "number", "minimum": 0}, in_stock=BOOL)),
    ("Where is the Eiffel Tower?",
     _obj(["city", "zip"], city=S, zip={"anyOf": [S, {"type": "null"}]})),
    ("Give coordinates for a trip from Paris to Berlin.",
     {"$defs": {"point": POINT}, "type": "object",
      "properties": {"origin": {"$ref": "#/$defs/point"},
                     "destination": {"$ref": "#/$defs/point"}},
      "required": ["origin", "destination"], "additionalProperties": False}),
    ("Create a to-do item for buying milk.",
     _obj(title=S, priority={"enum": ["low", "medium", "high"]}, done=BOOL,
          kind={"const": "todo"})),
    ("Which month number is March?", {"type": "integer", "minimum": 1, "maximum": 12}),
]
MAX_TOKENS = 96

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.", "strict": True,
    "parameters": _obj(city=S, unit={"type": "string", "enum": ["celsius", "fahrenheit"]})}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a time zone.", "strict": True,
    "parameters": _obj(timezone=S)}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What's the weather like in Paris right now?"}]
