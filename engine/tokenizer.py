"""Text <-> token ids and chat prompts, from a model directory's tokenizer files.

Built on the `tokenizers` library and jinja2 directly: transformers takes seconds to import and
is only a test dependency. Chat templates render in a sandbox with the same environment
conventions transformers uses (trim_blocks, lstrip_blocks, loop controls, `raise_exception`,
`tojson`, `strftime_now`, the `{% generation %}` block), so a model's template produces the
prompt it was trained on.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from kvguard.engine.model_config import ModelLoadError, cache_remedy

# encode_within: the first prefix tried holds this many characters a token of the limit (few
# tokens are longer), and a prefix is over the limit only by more than PREFIX_SLACK tokens
PREFIX_CHARS = 16
PREFIX_SLACK = 64

log = logging.getLogger("kvguard.engine")

# the special-token roles transformers gives a chat template as variables (and reads from
# special_tokens_map.json)
_SPECIAL_ROLES = (
    "bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token",
)  # fmt: skip

# the roles transformers' LlamaTokenizer and CodeLlamaTokenizer (also named ...Fast) take where
# no file names them: their __init__ defaults
_LLAMA_CLASS_ROLES = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
_LLAMA_CLASSES = ("LlamaTokenizer", "CodeLlamaTokenizer")
# config.json model types (of those kvguard serves) that transformers loads with a tokenizer
# class of their own whatever tokenizer_class says: mistral's plain tokenizer.json, Qwen2's
_OWN_TOKENIZER_TYPES = ("mistral", "qwen2")

# a byte-fallback vocabulary's token for one byte (SentencePiece's spelling: <0xE4>)
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte, inverted: printable Latin-1 bytes stand for
    themselves, the others (controls, space, 0x7F-0xA0, 0xAD) for U+0100 on, in byte order."""
    shown = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    hidden = [b for b in range(256) if b not in shown]
    return {chr(b): b for b in shown} | {chr(0x100 + k): b for k, b in enumerate(hidden)}


_BYTE_LEVEL = _byte_level_alphabet()
_UNKNOWN = object()

# the texts of the conversations `Tokenizer.template_layout` renders to learn what its chat
# template takes: words no template writes of its own, so finding one in the prompt means the
# message was rendered
_PROBE_SYSTEM = "kvguard-probe-system"
_PROBE_USERS = ("kvguard-probe-first", "kvguard-probe-second")


@dataclass(frozen=True, slots=True)
class TemplateLayout:
    """What a chat template takes of the turns kvguard writes into a conversation: a system
    message (the client's, and kvguard's description of a request's tools), and user turns one
    after another (tool results are user turns, `daemon/tools.py`). Templates of Gemma and
    Mistral v0.1 refuse a system message; those of Mistral v0.1 and Llama 2 insist that user
    and assistant alternate."""

    system: bool = True  # renders a system message's text
    user_after_user: bool = True  # renders two user turns in a row


class Tokenizer:
    """A model's tokenizer: encode, decode, chat template, and its special token ids."""

    def __init__(
        self,
        backend: HFTokenizer,
        config: dict[str, Any],
        chat_template: str | None = None,
        model_eos_ids: tuple[int, ...] = (),
        model_bos_id: int | None = None,
        template_source: str = "the chat template",
    ) -> None:
        self._tok = backend
        self._config = config
        self.chat_template = chat_template
        self.template_source = template_source  # the file it came from, for its errors
        self.special_tokens = {role: _token_text(config.get(role)) for role in _SPECIAL_ROLES}
        self.eos_token_id = self._id_of(self.special_tokens["eos_token"])
        if self.eos_token_id is None and model_eos_ids:
            self.eos_token_id = model_eos_ids[0]
        self.eos_token_ids = {
            *model_eos_ids,
            *([] if self.eos_token_id is None else [self.eos_token_id]),
        }
        self.bos_token_id = self._id_of(self.special_tokens["bos_token"])
        if self.bos_token_id is None:
            self.bos_token_id = model_bos_id
        # every token id is below it (`id_end`): what the lm_head's width, a logit_bias and
        # the bytes of an id are held to
        self.vocab_size = id_end(backend)
        self._raw: dict[int, bytes | None] = {}  # token id -> raw_bytes, worked out once

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        """Read tokenizer.json, tokenizer_config.json (with special_tokens_map.json's roles,
        `_special_tokens_map`, and a Llama class's default roles, `_llama_class_roles`), the
        chat template (`_chat_template`) and the eos ids of config.json and
        generation_config.json (a chat model often ends turns with an id only those list). The
        template is compiled now: one that does not compile is a warning at load, naming its
        file, and each chat request's error (`apply_chat_template`)."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ModelLoadError(
                f"{file}: missing; a model directory needs tokenizer.json{cache_remedy(file)}"
            )
        try:
            backend = HFTokenizer.from_file(str(file))
        except Exception as e:  # the Rust parser raises plain Exception on bad JSON
            raise ModelLoadError(
                f"{file}: not a valid tokenizer.json ({e}){cache_remedy(file)}"
            ) from e
        config = _special_tokens_map(path, read_json(path / "tokenizer_config.json"))
        model = read_json(path / "config.json")
        config = _llama_class_roles(path, config, model, backend)
        generation = read_json(path / "generation_config.json")
        eos = (
            *_ids(model.get("eos_token_id"), path / "config.json"),
            *_ids(generation.get("eos_token_id"), path / "generation_config.json"),
        )
        template, source = _chat_template(path, config)
        tok = cls(
            backend,
            config,
            template,
            tuple(dict.fromkeys(eos)),
            model.get("bos_token_id"),
            template_source=source,
        )
        if isinstance(tok._compiled, str):
            log.warning(
                "%s; chat requests are answered with this error until the template is fixed "
                "(plain prompts are served)",
                tok._compiled,
            )
        tok.template_layout  # noqa: B018 - probed at load: its log line comes at start
        return tok

    # -- ids <-> text ----------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids; special tokens written in the text (e.g. <|im_start|>) become their ids.

        add_special_tokens adds what the tokenizer's post-processor adds (e.g. BOS for Llama).
        """
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_within(
        self, text: str, add_special_tokens: bool, limit: int
    ) -> tuple[list[int], bool]:
        """`encode(text)` and True, or, for a text that holds more than `limit` tokens, the ids
        of a prefix already holding more (the whole text, where it was short enough to be
        tokenized whole) and False: the cost is set by `limit`, not by the text (a prompt of
        megabytes is refused after tokenizing a few times `limit` tokens' worth of it). A
        prefix counts as over only with PREFIX_SLACK tokens to spare, more than a cut through
        the text can add; the whole text is counted exactly."""
        n = PREFIX_CHARS * (limit + PREFIX_SLACK)
        while n < len(text):
            ids = self.encode(text[:n], add_special_tokens)
            if len(ids) > limit + PREFIX_SLACK:
                return ids, False
            n *= 4
        ids = self.encode(text, add_special_tokens)
        return ids, len(ids) <= limit

    def backend_json(self) -> str:
        """The tokenizer as tokenizer.json text (what a grammar library builds its view from)."""
        return self._tok.to_str()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def text_guard(self) -> list[int]:
        """Tokens of plain text (`a`) that decoding a window with no text of its own starts
        with, then leaves out: a decoder that takes the first space off a text (SentencePiece's
        `Strip`, after its dummy prefix) takes the guard's, not an answer token's (`▁The`
        after a prompt of special tokens only is ` The`, as after any other prompt)."""
        ids = self.encode("a")
        return ids if self.decode(ids) else []

    def raw_bytes(self, token_id: int) -> bytes | None:
        """The bytes an answer's token adds where its text alone is not whole characters: a
        byte-fallback token (`<0xE4>`, even an ASCII one: decoding reads a run of them as one
        string) or a byte-level BPE token holding part of a character or an invalid byte.
        b"" for a special token (decoding an answer leaves it out); None for a token whose
        text is whole characters, or whose bytes this tokenizer does not spell."""
        raw = self._raw.get(token_id, _UNKNOWN)
        if raw is not _UNKNOWN:
            return raw  # type: ignore[return-value]
        piece = self._tok.id_to_token(token_id)
        text = self.decode([token_id], skip_special_tokens=False)
        raw = None
        if piece is None or text != self.decode([token_id]):  # past the vocabulary, special
            raw = b""
        elif (byte := _BYTE_PIECE.fullmatch(piece)) and text != piece:
            raw = bytes([int(byte[1], 16)])
        elif "\ufffd" in text and all(ch in _BYTE_LEVEL for ch in piece):
            raw = bytes(_BYTE_LEVEL[ch] for ch in piece)
        self._raw[token_id] = raw
        return raw

    def special_token_ids(self) -> dict[str, int]:
        """Its special tokens, text -> id: the added tokens marked special, which an answer's
        text leaves out and which encoding a text makes of their text wherever it is written."""
        added = self._tok.get_added_tokens_decoder()
        return {t.content: i for i, t in sorted(added.items()) if t.special and t.content}

    @cached_property
    def text_tokens(self) -> dict[str, int]:
        """Its added tokens that are text, not special (Qwen2.5's `<tool_call>`), text -> id:
        an answer keeps their text, yet the grammar library's view of the tokenizer counts
        every added token as special, so a grammar's literal of that text must name the token
        by id for the model to write it (daemon/tools.py `grammar`)."""
        added = self._tok.get_added_tokens_decoder()
        return {t.content: i for i, t in sorted(added.items()) if not t.special and t.content}

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    # -- chat ------------------------------------------------------------------------------
    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render messages into the prompt text the model was fine-tuned on.

        Extra keyword arguments (e.g. tools) are passed to the template as variables. `tools`
        and `documents` are None unless given, as transformers and vLLM pass them: a template
        testing `tools is not none` renders their prompt, not a tools prompt or an error.
        ValueError where the template refuses the messages (`raise_exception`), ChatTemplateError
        where it fails on its own (the server's fault, whatever the client sent).
        """
        if self._template is None:
            raise ValueError("this model has no chat template: send a plain prompt instead")
        variables: dict[str, Any] = {"tools": None, "documents": None}
        variables |= {k: v for k, v in self.special_tokens.items() if v is not None}
        variables.update(kwargs)
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except TemplateRefusal as e:
            raise ValueError(f"chat template rejected the messages: {e}") from e
        except Exception as e:  # noqa: BLE001 - any other error is the template's own bug
            raise ChatTemplateError(
                f"the chat template in {self.template_source} fails: {type(e).__name__}: {e}"
            ) from e

    @cached_property
    def template_layout(self) -> TemplateLayout:
        """What the chat template takes (`TemplateLayout`), found once (`from_dir` asks at
        load, so the log says it at start) by rendering two tiny conversations: [system, user],
        then two user turns in a row, after a system message where it takes one (as chat
        lays a conversation out for it then: a template that wants a system message first
        would refuse them alone). It takes a turn where it renders each message's text without
        refusing. Asked of the template itself, not guessed from a request's refusal: the
        layout is known before a request is rendered (the special-token check reads the texts
        as they will be laid out), every request of a conversation is laid out alike (its
        prompt prefixes stay cached), and a template that leaves a system message out silently
        is caught too. A template that fails on its own, or none, is taken to take both: each
        request meets its error as before."""
        system = self._renders([("system", _PROBE_SYSTEM), ("user", _PROBE_USERS[0])])
        users = [("user", text) for text in _PROBE_USERS]
        layout = TemplateLayout(
            system=system,
            user_after_user=self._renders([("system", _PROBE_SYSTEM), *users] if system else users),
        )
        if layout != TemplateLayout():
            log.info(
                "the chat template in %s takes %s: a system message's text and the tools go %s, "
                "and the tool results of one assistant turn %s",
                self.template_source,
                _layout_words(layout),
                "in a system message" if layout.system else "before the first user turn's text",
                "are user turns of their own"
                if layout.user_after_user
                else "and a user message right after them are one user turn",
            )
        return layout

    def _renders(self, turns: list[tuple[str, str]]) -> bool:
        """Whether the chat template renders the text of each of `turns` (role, text), neither
        refusing them (`raise_exception`) nor leaving one out. True where there is no compiled
        template or it fails on its own: nothing is known to be refused."""
        if not isinstance(self._compiled, jinja2.Template):
            return True
        try:
            text = self.apply_chat_template([{"role": r, "content": c} for r, c in turns])
        except ChatTemplateError:
            return True
        except ValueError:
            return False
        return all(content in text for _, content in turns)

    @property
    def _template(self) -> jinja2.Template | None:
        """The compiled template (None: the model has none); ModelLoadError naming its file
        where it does not compile: the server's fault, not the messages'."""
        compiled = self._compiled
        if isinstance(compiled, str):
            raise ModelLoadError(compiled)
        return compiled

    @cached_property
    def _compiled(self) -> jinja2.Template | str | None:
        """Compiled once (`from_dir` does it at load), or why it does not compile."""
        if self.chat_template is None:
            return None
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            return env.from_string(self.chat_template)
        except jinja2.TemplateSyntaxError as e:
            where = self.template_source
            return f"the chat template in {where} does not compile: {e} (line {e.lineno})"


def _layout_words(layout: TemplateLayout) -> str:
    """What a template that does not take everything refuses, for the log."""
    refused = [
        *([] if layout.system else ["no system message"]),
        *([] if layout.user_after_user else ["no two user turns in a row"]),
    ]
    return " and ".join(refused)


class TemplateRefusal(jinja2.TemplateError):
    """`raise_exception(message)` in a chat template: the template refusing these messages
    (roles that do not alternate, a role it has no turn for), the client's to change."""


class ChatTemplateError(ModelLoadError):
    """A chat template that fails on its own while rendering (a TypeError, a name it never
    defined), not by `raise_exception`: like one that does not compile, the server's fault,
    which no change to the messages is known to cure."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`, which transformers' templates use to mark the
    assistant's tokens for training (TRL's assistant-only loss): serving has nothing to mark,
    so its body renders as it is, in a scope of its own as a block's body has."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def id_end(backend: HFTokenizer) -> int:
    """The tokenizer's highest token id + 1 (added tokens included), not its count of tokens:
    ids may have gaps (a vocabulary with ids 0, 2, 3 and 6 has 4 tokens but writes id 6), and
    a width of the count would leave the top ids, perhaps the eos id, out of the lm_head."""
    return max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1


def read_json(file: Path) -> dict[str, Any]:
    """An optional JSON object file of a model directory: absent means empty, unreadable or
    not an object is an error naming it."""
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{file}: not valid JSON ({e}){cache_remedy(file)}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file}: expected a JSON object{cache_remedy(file)}")
    return data


def _ids(value: Any, file: Path) -> tuple[int, ...]:
    """A file's `eos_token_id`: null, an id or a list of ids, as transformers takes it. An id
    is a whole number (2.0 is 2); true or 2.7 is refused rather than read as id 1 or 2."""
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    for v in ids:
        if isinstance(v, bool) or not (
            isinstance(v, int) or (isinstance(v, float) and v.is_integer())
        ):
            raise ModelLoadError(
                f"{file}: eos_token_id is {value!r}, expected a token id or a list of them"
            )
    return tuple(int(v) for v in ids)


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as an AddedToken object."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _special_tokens_map(path: Path, config: dict[str, Any]) -> dict[str, Any]:
    """`config` (tokenizer_config.json) with the special-token roles of special_tokens_map.json,
    as transformers reads them: older checkpoints keep bos/eos/unk/pad there alone, and without
    them a template's `{{ bos_token }}` renders empty. transformers reads the map only for a
    config without `added_tokens_decoder` (one saved before that key existed), and there the
    map's role wins over the config's."""
    file = path / "special_tokens_map.json"
    if "added_tokens_decoder" in config or not file.is_file():
        return config
    roles = read_json(file)
    return config | {role: roles[role] for role in _SPECIAL_ROLES if role in roles}


def _llama_class_roles(
    path: Path, config: dict[str, Any], model: dict[str, Any], backend: HFTokenizer
) -> dict[str, Any]:
    """`config` with the roles no file names filled from the Llama class's defaults, where
    transformers loads the directory with that class: older or hand-made Llama-2 directories
    name no roles, and without them Llama-2's template fails on `bos_token` and a Mistral
    template's prompt loses its BOS. A role a file names, even as null, is kept; a default
    the vocabulary lacks is left unset (transformers would add it as a new token, past the
    model's embeddings)."""
    missing = [role for role in _LLAMA_CLASS_ROLES if role not in config]
    cls = _llama_class(config, model, backend) if missing else None
    if cls is None:
        return config
    defaults = {role: _LLAMA_CLASS_ROLES[role] for role in missing}
    filled = {role: t for role, t in defaults.items() if backend.token_to_id(t) is not None}
    if filled:
        log.info(
            "%s: the tokenizer files name no %s; %s's defaults filled in, as transformers "
            "fills them: %s",
            path,
            ", ".join(filled),
            cls,
            ", ".join(f"{role}={token!r}" for role, token in filled.items()),
        )
    return config | filled


def _llama_class(config: dict[str, Any], model: dict[str, Any], backend: HFTokenizer) -> str | None:
    """The Llama tokenizer class transformers 5's AutoTokenizer loads this directory with, or
    None: tokenizer_config.json's `tokenizer_class` (else config.json's), unless the model
    type has a tokenizer of its own; a `LlamaTokenizer` whose tokenizer.json is byte-level
    (Llama 3's, often so labelled) is loaded as it is written, with no class defaults."""
    declared = config.get("tokenizer_class") or model.get("tokenizer_class")
    if not isinstance(declared, str) or model.get("model_type") in _OWN_TOKENIZER_TYPES:
        return None
    cls = declared.removesuffix("Fast")
    if cls not in _LLAMA_CLASSES:
        return None
    if cls == "LlamaTokenizer" and _is_byte_level(backend):
        return None
    return cls


def _is_byte_level(backend: HFTokenizer) -> bool:
    """Whether the tokenizer's pre-tokenizer or decoder is ByteLevel (alone or in a Sequence,
    as Llama 3's pre-tokenizer is): what makes a tokenizer.json byte-level, as transformers
    means it. Only those two parts are looked at, already parsed: the text "ByteLevel" in a
    SentencePiece vocabulary, added token or normalizer says nothing of the kind. (transformers
    5 searches the file's text, so for such a rare SentencePiece file it leaves the roles
    unset where kvguard fills `<s>`, `</s>`, `<unk>`: a chat template then renders here.)"""
    parts = (backend.pre_tokenizer, backend.decoder)
    return any(
        part is not None and _has_type(json.loads(part.__getstate__()), "ByteLevel")
        for part in parts
    )


def _has_type(spec: Any, name: str) -> bool:
    """Whether a serialized tokenizer part, or any part nested in it (a Sequence's), is of
    type `name`."""
    if isinstance(spec, list):
        return any(_has_type(item, name) for item in spec)
    if not isinstance(spec, dict):
        return False
    return spec.get("type") == name or any(_has_type(value, name) for value in spec.values())


def _chat_template(path: Path, config: dict[str, Any]) -> tuple[str | None, str]:
    """The default chat template and the file it came from, found as transformers finds it:
    chat_template.jinja (and additional_chat_templates/NAME.jinja), where a directory has such
    files, take priority over tokenizer_config.json's `chat_template` (a string, or a list of
    named templates). Of named templates the one named `default` is rendered (kvguard describes
    tools in the messages, not by a `tool_use` template); without one there is none, as
    transformers then has no template to pick."""
    files = {}
    if (path / "chat_template.jinja").is_file():
        files["default"] = path / "chat_template.jinja"
    extra = path / "additional_chat_templates"
    if extra.is_dir():
        files |= {f.name.removesuffix(".jinja"): f for f in sorted(extra.glob("*.jinja"))}
    config_file = path / "tokenizer_config.json"
    if files:
        file = files.get("default")
        if file is None:
            log.warning(
                "%s holds chat templates %s but none named default (chat_template.jinja): "
                "this model has no chat template to serve, as transformers has none to pick",
                extra,
                sorted(files),
            )
            return None, str(extra)
        try:
            template = file.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ModelLoadError(f"{file}: not UTF-8 text ({e})") from e
        beside = ""
        if "chat_template" in config:
            beside = " (tokenizer_config.json's chat_template is not used: the file comes first)"
        log.info("chat template: %s%s", file, beside)
        return template, str(file)
    template = config.get("chat_template")
    source = f"{config_file} (chat_template)"
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
        source = f"{config_file} (chat_template named default)"
    if not isinstance(template, str):
        return None, source
    log.info("chat template: %s", source)
    return template, source


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Templates expect non-ASCII kept as is (jinja's own tojson escapes it and HTML chars)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise TemplateRefusal(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)
