"""A JSON request body's fields, read with the checks and the OpenAI-style 400s every route shares:
the body an object, the model one this server serves, token ids in the vocabulary, a boolean, an
integer or a number in its range; the error names the field (cli/http/requests.py's routes)."""

from __future__ import annotations

from typing import Any

from .errors import ApiError


def json_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def model_name(body: dict[str, Any], model_names: list[str], required: bool) -> str | None:
    model = body.get("model")
    if model is None:
        if required:
            raise ApiError(400, "you must provide a model parameter", "model", "missing_required_parameter")
        return None
    if not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", "model", "invalid_type")
    if model not in model_names:
        raise ApiError(404, f"The model `{model}` does not exist or you do not have access to it. "
                            f"This server serves: {', '.join(model_names)}.", "model", "model_not_found")
    return model


def is_ids(values: list[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in values)


def check_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is outside the vocabulary (0-{vocab_size - 1})", param, "invalid_value")


def bool_field(body: dict[str, Any], name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"Invalid type for '{param or name}': expected a boolean", param or name, "invalid_type")
    return value


def int_field(body: dict[str, Any], name: str, default: Any, low: int, high: int | None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ApiError(400, f"Invalid type for '{name}': expected an integer, but got {type(value).__name__}",
                       name, "invalid_type")
    if value < low:
        raise ApiError(400, f"Invalid '{name}': integer below minimum value. Expected a value >= {low}, but got "
                            f"{value} instead.", name, "integer_below_min_value")
    if high is not None and value > high:
        raise ApiError(400, f"Invalid '{name}': integer above maximum value. Expected a value <= {high}, but got "
                            f"{value} instead.", name, "integer_above_max_value")
    return value


def number_field(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        raise ApiError(400, f"Invalid type for '{name}': expected a number", name, "invalid_type")
    if not low <= value <= high:
        raise ApiError(400, f"Invalid '{name}': expected a number in [{low:g}, {high:g}], but got {value}", name,
                       "invalid_value")
    return float(value)
