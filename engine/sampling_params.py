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
    # and shared by every row these params sample; `validate` drops them
    bias_cache: dict[Any, Any] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        self.bias_cache = None  # built again from what is validated now
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
        if not isinstance(self.logit_bias, dict) or any(
            not isinstance(t, int)
            or isinstance(t, bool)
            or t < 0
            or isinstance(b, bool)
            or not isinstance(b, int | float)
            or not abs(b) <= MAX_LOGIT_BIAS
            for t, b in self.logit_bias.items()
        ):
            raise ValueError(
                f"logit_bias={self.logit_bias!r}: expected token ids >= 0 mapped to numbers "
                "in [-100, 100]"
            )
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
