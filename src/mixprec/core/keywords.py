"""Keyword defaults that know they were not passed.

A face whose options have peer defaults (Apex's amp.initialize, Colossal's scaler keywords)
writes `Default(value)` in its signature: `help()` shows the value, and the face can tell a
keyword the caller passed (honoured or refused, whatever its value, even one equal to the
default) from one left out (the mode's own setting applies).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Default:
    """A keyword's default in a signature: the value it stands for, and the mark that the
    caller did not pass it. A passed value, even an equal one, is never a Default."""

    value: Any

    def __repr__(self) -> str:
        return repr(self.value)


def passed(keywords: Mapping[str, Any]) -> dict[str, Any]:
    """The keywords the caller passed (those that are not a Default)."""
    return {k: v for k, v in keywords.items() if not isinstance(v, Default)}


def value_of(keyword: Any) -> Any:
    """A keyword's value: the passed one, or the value its Default stands for."""
    return keyword.value if isinstance(keyword, Default) else keyword


__all__ = ["Default", "passed", "value_of"]
