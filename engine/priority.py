"""Request priorities by name, and the admission halt's `allow_priority`, read one way by the
engine's control surface, the rules file and the admin API (torch-free: `kvguard rules check`
reads it too)."""

from __future__ import annotations

PRIORITIES = {"high": 0, "normal": 1, "low": 2}
PRIORITY_NAMES = {v: k for k, v in PRIORITIES.items()}
# the halt that admits no priority at all, as `allow_priority` spells it besides None
ALLOW_NONE = "none"


def parse_priority(value: str | int) -> int:
    """`high|normal|low` (or 0/1/2) to the scheduler's rank; lower ranks are served first."""
    if isinstance(value, int) and not isinstance(value, bool) and value in PRIORITY_NAMES:
        return value
    if isinstance(value, str) and value.lower() in PRIORITIES:
        return PRIORITIES[value.lower()]
    raise ValueError(f"priority={value!r}: expected one of high, normal, low")


def parse_allow_priority(value: str | int | None) -> str | None:
    """An admission halt's `allow_priority`: the name of the lowest priority still admitted
    (`high|normal|low`, as `parse_priority` reads them), or None where no priority is: None
    itself or "none", which is how `kvguard status`, the halt's detail and the engine's knob
    show that halt, so that an operator types it back. One reading for the library's
    `halt_admission`, a rule's params and the admin API's (`rules.actions.Halt`)."""
    if value is None or (isinstance(value, str) and value.lower() == ALLOW_NONE):
        return None
    try:
        return PRIORITY_NAMES[parse_priority(value)]
    except ValueError:
        raise ValueError(
            f"allow_priority={value!r}: expected one of high, normal, low, or none "
            "(or None: halted for every priority)"
        ) from None
