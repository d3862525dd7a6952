"""Parts of a request told apart by their `type` field (Responses input items, Messages content blocks): each
checked against its own model, so that the error for a bad one names it and its field, not every branch of a union.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from moeserve.errors import RequestError
from moeserve.server.protocol import printable


def first_error(err: ValidationError) -> str:
    """The first validation error as `path: message` (the path as the client wrote it)."""
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"] if isinstance(p, int) or str(p).isidentifier())
    return f"{where}: {first['msg']}" if where else str(first["msg"])


def parse_part(raw: dict[str, Any], models: dict[str, type[BaseModel]], where: str, param: str,
               default_type: str | None = None) -> Any:
    """`raw` as the model of its `type` (`default_type` when it has none). Raises RequestError naming `where`."""
    kind = raw.get("type", default_type)
    model = models.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise RequestError(f"{where}: parts of type {printable(str(kind))!r} are not supported (known: "
                           f"{', '.join(models)})", param=param)
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        raise RequestError(f"{where}.{first_error(err)}", param=param) from None
