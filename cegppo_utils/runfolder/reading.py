"""A run's JSON files and JSON-lines files, read by one rule."""

import json
import os

from cegppo_utils.data import UserError, first_line


def read_jsonl(path: str) -> list[dict]:
    """The rows of a JSON-lines file; a torn (unparsable) line is skipped."""
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return rows


def read_json_object(path, prefix="", suffix="") -> dict:
    """A JSON file that must hold an object (config.json): anything else is one line naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        raise UserError(f"{prefix}{path} is missing{suffix}") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        why = e.strerror if isinstance(e, OSError) else f"not valid JSON: {first_line(e)}"
        raise UserError(f"{prefix}{path} is not readable ({why}){suffix}") from None
    if not isinstance(value, dict):
        raise UserError(f"{prefix}{path} is not a JSON object{suffix}")
    return value
