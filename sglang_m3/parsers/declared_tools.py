"""Which declared tool an invoke's `name` attribute means.

1. The name exactly as written.
2. Otherwise the one declared name equal to it case-insensitively (models now and then
   capitalise a name): the call is reported under the declared spelling, with a debug log
   line. When several declared names differ only in case the intent is ambiguous and none
   is taken.
3. Otherwise no tool: the invoke stays content. Only when SGLang is told to forward unknown
   tools (`SGLANG_FORWARD_UNKNOWN_TOOLS`) is an undeclared name parsed, untyped, under the
   name written; the parser itself never guesses a tool that was not declared.
"""

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeclaredTool:
    name: str
    parameters: Any  # the JSON schema of its arguments; None when untyped


# Maps the name an invoke gives to the tool it means, or raises KeyError.
ToolLookup = Callable[[str], DeclaredTool]


def tool_lookup(functions: Optional[Dict[str, Any]], accept_unknown: bool = False) -> ToolLookup:
    """A `ToolLookup` over declared name -> parameters schema."""
    functions = functions or {}
    by_folded_name: Dict[str, List[str]] = {}
    for declared in functions:
        by_folded_name.setdefault(declared.casefold(), []).append(declared)

    def lookup(name: str) -> DeclaredTool:
        if name in functions:
            return DeclaredTool(name, functions[name])
        candidates = by_folded_name.get(name.casefold(), [])
        if len(candidates) == 1:
            logger.debug("tool call names %r; taken as the declared tool %r (case differs)", name, candidates[0])
            return DeclaredTool(candidates[0], functions[candidates[0]])
        if accept_unknown:
            return DeclaredTool(name, None)
        raise KeyError(name)

    return lookup
