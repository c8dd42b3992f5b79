"""Reading protobuf messages at the services' edges."""

from __future__ import annotations

from typing import Any

from google.protobuf.message import Message


def set_optional_fields(msg: Message) -> dict[str, Any]:
    """The presence-tracked fields (proto3 ``optional``) that ``msg`` sets, by name: what the sender chose, apart
    from what it left to the defaults (an unset temperature and a temperature of 0 differ)."""
    return {field.name: value for field, value in msg.ListFields() if field.has_presence}
