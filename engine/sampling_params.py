"""Per-request decoding parameters, validated when the request is added."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# Below this temperature a request decodes greedily, which is the limit it tends to: dividing
# fp32 logits by a smaller one (1e-320 is a valid JSON number) overflows them to inf, and the
# softmax of inf is NaN, which no sampler can draw from.
GREEDY_BELOW_TEMPERATURE = 1e-5
# The most alternatives a sampled token's log-probability comes with (OpenAI's chat limit).
MAX_LOGPROBS = 20
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], as OpenAI's do
MAX_LOGIT_BIAS = 100.0  # a logit bias lies in [-100, 100]
# Stop strings one request may give, and characters in each (OpenAI allows 4 strings). Every
# output token of every choice is checked against each of them on the engine thread, so their
# number and length bound work that every other request waits for.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024


def is_int(v: Any) -> bool:
    """An int, not a bool (Python counts True as 1; `top_k=True` is a typo, not 1)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """A real number (an int, a float, a numpy float), not a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def split_ids(items: Iterable[Any]) -> tuple[list[int], list[Any]]:
    """The items that are token ids, as ints (ints, numpy or torch integers), and those that
    are not (bools, floats, strings, anything else)."""
    ids, wrong = [], []
    for t in items:
        try:
            if isinstance(t, bool):
                raise TypeError
            ids.append(operator.index(t))
        except TypeError:
            wrong.append(t)
    return ids, wrong


def token_ids(v: Any) -> list[int] | None:
    """`v` as a list of token ids >= 0 (any iterable of ints, numpy or torch integers
    included, but not a string, bytes or bools), or None where it is not one."""
    if isinstance(v, str | bytes | bytearray):
        return None
    try:
        ids, wrong = split_ids(v)
    except TypeError:  # not iterable
        return None
    return ids if not wrong and all(t >= 0 for t in ids) else None


class CheckedBias(dict[int, float]):
    """A `logit_bias` as `SamplingParams.validate` checked it: a read-only copy of it (so that
    it stays as checked; built only by checking what it is built from), with its largest
    token id (`max_id`, -1 when empty) for the engine's vocabulary check. Params holding one
    are not checked again: a request's choices share their params (the same params, copies,
    `dataclasses.replace`), and a whole-vocabulary bias took 22 ms a check, once per choice on
    the engine thread (0.7 s for n=32, while every other request's decode waited)."""

    __slots__ = ("max_id",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        largest = _largest_id(self)
        if largest is None:
            raise ValueError("logit_bias: expected token ids >= 0 mapped to numbers in [-100, 100]")
        self.max_id = largest

    def _read_only(self, *_: Any, **__: Any) -> Any:
        raise TypeError("a validated logit_bias is read-only: assign a new dict instead")

    __setitem__ = __delitem__ = __ior__ = _read_only
    clear = pop = popitem = setdefault = update = _read_only

    def __reduce__(self) -> tuple[Any, ...]:  # copies and pickles: checked again when built
        return (CheckedBias, (dict(self),))


def _largest_id(bias: dict[Any, Any]) -> int | None:
    """The largest token id in `bias` (-1 when empty) where it maps token ids (ints >= 0) to
    numbers in [-100, 100], else None. Plain ints to ints and floats, the JSON API's, are
    checked by builtins over the whole dict (half the time of checking them one by one)."""
    values = bias.values()
    if set(map(type, bias)) <= {int} and set(map(type, values)) <= {int, float}:
        within = all(map(MAX_LOGIT_BIAS.__ge__, map(abs, values)))  # NaN is not
        return max(bias, default=-1) if within and min(bias, default=0) >= 0 else None
    for t, b in bias.items():  # subclasses (not bool) or wrong types: one by one
        if (
            not isinstance(t, int)
            or isinstance(t, bool)
            or t < 0
            or isinstance(b, bool)
            or not isinstance(b, int | float)
            or not abs(b) <= MAX_LOGIT_BIAS
        ):
            return None
    return max(bias, default=-1)


def check_logit_bias(value: Any) -> CheckedBias:
    """`value`, a dict of token ids (ints >= 0) to numbers in [-100, 100], as a CheckedBias
    (itself where it is one), or a ValueError naming it."""
    if type(value) is CheckedBias:
        return value
    if isinstance(value, dict):
        try:
            return CheckedBias(value)
        except ValueError:
            pass
    raise ValueError(
        f"logit_bias={value!r}: expected token ids >= 0 mapped to numbers in [-100, 100]"
    )


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 0 keeps the single most likely token: greedy, its limit
    seed: int | None = None  # per-request generator: same seed, same output
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # None: no log-probabilities; k >= 0: each sampled token's, with the k most likely tokens'
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # likewise for each prompt token after the first
    # subtracted from a token's logit once it is in the output (presence), and per time it
    # is (frequency); the prompt's tokens do not count
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    # the output is JSON matching this schema ({"type": "object"}: any object); see structured.py
    json_schema: dict[str, Any] | None = None
    # or a grammar the output must match: Lark text in llguidance's dialect (tool calls use it)
    grammar: str | None = None
    # the sampler's tensors of `logit_bias`, built on its first use (`sampler._bias_tensors`)
    # and shared by every row these params sample; `validate` drops them when it checks a new
    # bias (a validated one, a CheckedBias, is read-only: it cannot change under them)
    bias_cache: dict[Any, Any] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        self._plain_ints()
        if (
            not isinstance(self.max_tokens, int)
            or isinstance(self.max_tokens, bool)
            or self.max_tokens <= 0
        ):
            raise ValueError(f"max_tokens={self.max_tokens!r}: expected an integer >= 1")
        # the type first: None or '0.9' would otherwise fail the comparison with a TypeError
        if not is_number(self.temperature) or not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"temperature={self.temperature!r}: expected a finite number >= 0")
        if self.seed is not None and (not is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            raise ValueError(
                f"seed={self.seed!r}: expected an integer in [-2**63, 2**64), as torch seeds"
            )
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}: expected an integer >= 0 (0 disables)")
        if not is_number(self.top_p) or not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r}: expected a number in [0, 1]")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: expected a bool")
        # read on every output token: a wrong type would end the request in the step instead
        ids = token_ids(self.stop_token_ids)
        if ids is None:
            raise ValueError(
                f"stop_token_ids={self.stop_token_ids!r}: expected a list of token ids "
                "(integers >= 0)"
            )
        self.stop_token_ids = ids  # a set or numpy ids, as the plain list the steps read
        if not isinstance(self.stop, list | tuple):
            raise ValueError(f"stop={self.stop!r}: expected a string or a list of strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(
                f"stop=<{len(self.stop)} strings>: expected at most {MAX_STOP_STRINGS} stop strings"
            )
        for i, s in enumerate(self.stop):
            if isinstance(s, str) and len(s) > MAX_STOP_CHARS:
                raise ValueError(
                    f"stop=<element {i} of {len(s)} characters>: expected stop strings of at "
                    f"most {MAX_STOP_CHARS} characters"
                )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop={self.stop!r}: expected non-empty strings")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not abs(v) <= MAX_PENALTY:
                raise ValueError(f"{name}={v!r}: expected a number in [-2, 2]")
        # checked once (a CheckedBias is as it was checked): O(1) for a request's next choices
        if type(self.logit_bias) is not CheckedBias:
            self.logit_bias = check_logit_bias(self.logit_bias)
            self.bias_cache = None  # built again from what is validated now
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise ValueError(
                f"json_schema={self.json_schema!r}: expected None or a JSON schema object"
            )
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise ValueError(f"grammar={self.grammar!r}: expected None or a Lark grammar")
        if self.grammar is not None and self.json_schema is not None:
            raise ValueError("grammar: give a grammar or a json_schema, not both")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (
                not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_LOGPROBS
            ):
                raise ValueError(f"{name}={v!r}: expected None or an integer 0..{MAX_LOGPROBS}")

    def _plain_ints(self) -> None:
        """Numpy integers in the count fields become ints, as they do among prompt ids: the
        checks below and the steps read Python ints (a bool stays, to be refused)."""
        for name in ("max_tokens", "top_k", "seed", "logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if isinstance(v, numbers.Integral) and not isinstance(v, int):
                setattr(self, name, int(v))

    def bias_ids_from(self, vocab: int) -> list[int]:
        """The validated `logit_bias`'s token ids >= `vocab`, in order: O(1) where there are
        none (the largest id is known), as for each choice of a request."""
        bias = check_logit_bias(self.logit_bias)
        return sorted(t for t in bias if t >= vocab) if bias.max_id >= vocab else []

    @property
    def adjusts_logits(self) -> bool:
        """Whether penalties or a logit bias change the logits before the draw."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    @property
    def greedy(self) -> bool:
        """The most likely token, no draw: a temperature too low to divide by, a top-k of 1,
        or a top-p of 0 (the nucleus keeps at least its most likely token, so only it)."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1 or self.top_p == 0

    @property
    def temperature_only(self) -> bool:
        """Sampled with a temperature and nothing else shaping the draw (no top-k or top-p)."""
        return not self.greedy and self.top_k <= 0 and self.top_p >= 1.0
