"""The tokenizer and chat template an artifact bundle carries, so that serving needs only the
``tokenizers`` library and ``jinja2`` (no ``transformers``).

:func:`bundle_tokenizer` runs at compile time. It takes a ``tokenizer.json``, a Hugging Face model
directory, or a GGUF file (its vocabulary built with ``tokenizers`` directly, :mod:`.gguf_vocab`, from
the metadata the shared reader ``zlc.gguf_reader`` reads; Gemma, Phi-3 and unigram vocabularies are
converted by ``transformers``) and writes two files into the bundle folder:

``tokenizer.json``
    the ``tokenizers`` serialization, loaded with ``tokenizers.Tokenizer.from_file``;
``tokenizer_config.json``
    a small normalized config of zlc's own (not Hugging Face's full config)::

        {"chat_template": str | None, "bos_token": str | None, "eos_token": str | None,
         "eos_token_ids": [int, ...], "add_bos_token": bool, "pad_token": str | None}

:class:`BundleTokenizer` loads such a folder at serve time: encode/decode, the chat template rendered
the way ``transformers``' ``apply_chat_template`` renders it (sandboxed jinja2, ``trim_blocks``,
``lstrip_blocks``, ``raise_exception``, ``tojson``), and :class:`IncrementalDecoder` for streaming.
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from zlc.errors import ZlcError

__all__ = ["CONFIG_FILE", "TOKENIZER_FILE", "BundleTokenizer", "IncrementalDecoder", "bundle_tokenizer"]

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"

#: End-of-sequence tokens recognised when a bare ``tokenizer.json`` says nothing about its eos
#: (first match among the tokenizer's special tokens wins).
_KNOWN_EOS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>", "<|end|>")

_REPLACEMENT = "\ufffd"


def _err(path: Path, what: str) -> ZlcError:
    """A one-line ZlcError naming ``path``."""
    return ZlcError(" ".join(f"{path}: {what}".split()))


# --------------------------------------------------------------------------------------------------
# compile time: bundle_tokenizer


def bundle_tokenizer(src: str | Path, dest: Path) -> dict[str, Any]:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for ``src`` into the folder ``dest``
    (created if needed) and return the config.

    ``src`` is a ``tokenizer.json`` file, a Hugging Face model directory (``tokenizer.json`` plus,
    optionally, ``tokenizer_config.json``, ``chat_template.jinja``, ``chat_template.json``,
    ``special_tokens_map.json``, ``generation_config.json``), or a GGUF file (converted with
    ``transformers``, needed at compile time only). Bad input raises :class:`ZlcError`.
    """
    src = Path(src)
    dest = Path(dest)
    if not src.exists():
        raise _err(src, "no such file or directory (expected a tokenizer.json, a model directory or a GGUF file)")
    if src.is_dir():
        if dest.exists() and dest.resolve() == src.resolve():
            raise _err(src, "the bundle folder is the source model directory; choose another destination")
        tokenizer, config = _from_hf_dir(src)
    elif _is_gguf(src):
        tokenizer, config = _from_gguf(src)
    else:
        tokenizer = _load_tokenizer_json(src)
        config = _infer_config(tokenizer, {}, {}, None)
        config["chat_template"] = None
    if config["chat_template"] is not None:
        try:
            _compile_chat_template(config["chat_template"])
        except Exception as e:  # jinja2.TemplateSyntaxError and friends
            raise _err(src, f"the chat template does not compile: {e}") from e

    dest.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(dest / TOKENIZER_FILE), pretty=False)
    (dest / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return config


def _load_tokenizer_json(path: Path) -> Any:
    from tokenizers import Tokenizer

    try:
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise _err(path, f"not a tokenizer.json or GGUF file ({type(e).__name__}: {e})") from e
    if not isinstance(data, dict) or "model" not in data:
        raise _err(path, "a JSON file, but not a tokenizers tokenizer.json (no 'model' entry)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception on schema mismatches
        raise _err(path, f"not a valid tokenizers tokenizer.json ({e})") from e


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise _err(path, f"unreadable JSON ({e})") from e
    if not isinstance(data, dict):
        raise _err(path, "expected a JSON object")
    return data


def _token_str(value: Any) -> str | None:
    """A special token as written in HF configs: a string, or an AddedToken dict with 'content'."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _pick_template(value: Any) -> str | None:
    """A chat template as HF stores it: a string, a list of {"name", "template"}, or a dict name -> str."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        value = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    if isinstance(value, dict):
        t = value.get("default")
        if isinstance(t, str):
            return t
        return next((t for t in value.values() if isinstance(t, str)), None)
    return None


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _from_hf_dir(src: Path) -> tuple[Any, dict[str, Any]]:
    tok_path = src / TOKENIZER_FILE
    if not tok_path.is_file():
        hint = ""
        ggufs = sorted(p.name for p in src.glob("*.gguf"))
        if ggufs:
            hint = f"; to use a GGUF file pass it directly (e.g. {src / ggufs[0]})"
        raise _err(src, f"model directory without a {TOKENIZER_FILE}{hint}")
    tokenizer = _load_tokenizer_json(tok_path)
    tcfg = _read_json(src / "tokenizer_config.json")
    specials = _read_json(src / "special_tokens_map.json")
    gen = _read_json(src / "generation_config.json")

    template: str | None = None
    jinja_file = src / "chat_template.jinja"
    if jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")
    if template is None:
        template = _pick_template(tcfg.get("chat_template"))
    if template is None:
        template = _pick_template(_read_json(src / "chat_template.json").get("chat_template"))

    tokens = {
        k: _token_str(tcfg.get(k)) or _token_str(specials.get(k)) for k in ("bos_token", "eos_token", "pad_token")
    }
    config = _infer_config(tokenizer, tokens, gen, tcfg.get("add_bos_token"))
    config["chat_template"] = template
    return tokenizer, config


def _infer_config(
    tokenizer: Any, tokens: dict[str, str | None], gen: dict[str, Any], add_bos: Any
) -> dict[str, Any]:
    """The normalized config from what a source declares, filling gaps from the tokenizer itself:
    a bos the post-processor prepends, and a well-known eos among the special tokens."""
    bos, eos, pad = tokens.get("bos_token"), tokens.get("eos_token"), tokens.get("pad_token")
    with_special = tokenizer.encode("a", add_special_tokens=True).ids
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    prepends = len(with_special) > len(plain) and with_special[len(with_special) - len(plain):] == plain
    if bos is None and prepends:
        bos = tokenizer.id_to_token(with_special[0])
    if bos is None and isinstance(gen.get("bos_token_id"), int):
        bos = tokenizer.id_to_token(gen["bos_token_id"])
    if not isinstance(add_bos, bool):
        add_bos = bool(prepends and bos is not None and tokenizer.token_to_id(bos) == with_special[0])
    if eos is None:
        gen_eos = _ids(gen.get("eos_token_id"))
        if gen_eos:
            eos = tokenizer.id_to_token(gen_eos[0])
    if eos is None:
        special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
        eos = next((t for t in _KNOWN_EOS if t in special), None)
    if pad is None and isinstance(gen.get("pad_token_id"), int):
        pad = tokenizer.id_to_token(gen["pad_token_id"])
    eos_ids = [tokenizer.token_to_id(eos)] if eos is not None else []
    eos_ids += _ids(gen.get("eos_token_id"))
    return {
        "chat_template": None,
        "bos_token": bos,
        "eos_token": eos,
        "eos_token_ids": _valid_ids(eos_ids, tokenizer.get_vocab_size(with_added_tokens=True)),
        "add_bos_token": bool(add_bos) and bos is not None,
        "pad_token": pad,
    }


def _valid_ids(ids: list[int | None], vocab: int) -> list[int]:
    out: list[int] = []
    for i in ids:
        if i is not None and 0 <= i < vocab and i not in out:
            out.append(i)
    return out


# GGUF --------------------------------------------------------------------------------------------

_GGUF_MAGIC = b"GGUF"
#: The chat template of a GGUF file without `tokenizer.chat_template`: ChatML (SmolLM2, Qwen), with
#: no default system prompt. The bundle's tokenizer_config.json says so (`chat_template_default`).
DEFAULT_GGUF_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _is_gguf(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == _GGUF_MAGIC
    except OSError as e:
        raise _err(path, f"cannot read ({e})") from e


def _gguf_reader(path: Path) -> Any:
    """The file's GGUFReader through the reader the GGUF frontend shares (zlc.gguf_reader: a compile
    that imported the model already holds it)."""
    try:
        from zlc.gguf_reader import open_gguf

        return open_gguf(path)
    except ImportError as e:
        raise _err(path, "bundling a GGUF tokenizer needs the gguf package (pip install 'zlc[hf]')") from e
    except OSError as e:
        raise _err(path, f"cannot read ({e.strerror or e})") from e
    except Exception as e:  # gguf raises ValueError/IndexError/struct errors on a damaged file
        why = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
        raise _err(path, f"truncated or corrupt GGUF header ({why})") from e


def _gguf_metadata(path: Path) -> dict[str, Any]:
    """The scalar and string metadata of a GGUF file (arrays, the vocabulary and merges, left out)."""
    from gguf import GGUFValueType

    reader = _gguf_reader(path)
    return {k: f.contents() for k, f in reader.fields.items() if f.types and f.types[0] != GGUFValueType.ARRAY}


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _from_gguf(src: Path) -> tuple[Any, dict[str, Any]]:
    meta = _gguf_metadata(src)
    if "tokenizer.ggml.model" not in meta:
        raise _err(src, "GGUF file has no tokenizer (no tokenizer.ggml.model metadata)")
    from .gguf_vocab import build

    try:
        tokenizer = build(_gguf_reader(src))
    except Exception as e:  # a vocabulary the tokenizers library refuses (merges naming unknown tokens, ...)
        raise _err(src, f"cannot build a tokenizer from this GGUF's vocabulary ({type(e).__name__}: {e})") from e
    if tokenizer is not None:
        return tokenizer, _gguf_config(src, meta, tokenizer)
    return _from_gguf_transformers(src, meta)


def _gguf_config(src: Path, meta: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """The bundle's config from the file's metadata, as transformers' conversion would set it."""
    reader = _gguf_reader(src)
    from zlc.gguf_reader import field

    tokens = field(reader, "tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    if add_bos is None and meta.get("tokenizer.ggml.model") == "llama":
        add_bos = True  # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise
    named = {"bos_token": token("bos"), "eos_token": token("eos"), "pad_token": token("padding")}
    return _gguf_finish(tokenizer, meta, named, add_bos, None)


def _gguf_finish(tokenizer: Any, meta: dict[str, Any], named: dict[str, str | None], add_bos: Any,
                 template: str | None) -> dict[str, Any]:
    config = _infer_config(tokenizer, named, {}, add_bos)
    # llama.cpp's end-of-turn / end-of-message tokens also end generation
    extra = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    config["eos_token_ids"] = _valid_ids(
        [*config["eos_token_ids"], *(i for i in extra if isinstance(i, int))],
        tokenizer.get_vocab_size(with_added_tokens=True),
    )
    if template is None:
        template = _pick_template(meta.get("tokenizer.chat_template"))
    if template is None:  # said in one line by the compile's tokenizer stage (docs/cli.md)
        template, config["chat_template_default"] = DEFAULT_GGUF_CHAT_TEMPLATE, True
    config["chat_template"] = template
    return config


def _from_gguf_transformers(src: Path, meta: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Gemma's and Phi-3's SentencePiece variants, unigram vocabularies: transformers' conversion."""
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise _err(src, "bundling a GGUF tokenizer needs transformers and gguf (pip install 'zlc[hf]')") from e
    try:
        with _quiet_transformers():
            hf = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    except Exception as e:  # unsupported tokenizer model, bad vocab, missing gguf package...
        raise _err(src, f"transformers could not build a tokenizer from this GGUF ({type(e).__name__}: {e})") from e
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise _err(src, f"transformers built a slow tokenizer ({type(hf).__name__}); zlc needs a fast one")

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(backend.to_str())
    tokens = {k: _token_str(getattr(hf, k, None)) for k in ("bos_token", "eos_token", "pad_token")}
    add_bos = meta.get("tokenizer.ggml.add_bos_token", getattr(hf, "add_bos_token", None))
    return tokenizer, _gguf_finish(tokenizer, meta, tokens, add_bos, _pick_template(getattr(hf, "chat_template", None)))


# --------------------------------------------------------------------------------------------------
# serve time: BundleTokenizer


def _compile_chat_template(source: str) -> Any:
    """Compile a chat template the way transformers does (``_compile_jinja_template``)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` (assistant-mask markers): renders its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _content_text(content: Any) -> str:
    """A message's text: a string, or the text parts of an OpenAI-style content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p.get("text", "") if isinstance(p, dict) else str(p) for p in content
        )
    return "" if content is None else str(content)


class BundleTokenizer:
    """A bundle folder's tokenizer: ``tokenizers`` for the vocabulary, jinja2 for the chat template."""

    def __init__(self, folder: Path):
        from tokenizers import Tokenizer

        self.folder = Path(folder)
        tok_path = self.folder / TOKENIZER_FILE
        if not tok_path.is_file():
            raise _err(self.folder, f"no {TOKENIZER_FILE} in the bundle")
        try:
            self._tok = Tokenizer.from_file(str(tok_path))
        except Exception as e:
            raise _err(tok_path, f"not a valid tokenizers tokenizer.json ({e})") from e
        cfg = _read_json(self.folder / CONFIG_FILE)
        self.config: dict[str, Any] = cfg
        self.bos_token: str | None = cfg.get("bos_token")
        self.eos_token: str | None = cfg.get("eos_token")
        self.pad_token: str | None = cfg.get("pad_token")
        self.bos_token_id: int | None = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.add_bos_token: bool = bool(cfg.get("add_bos_token")) and self.bos_token_id is not None
        self.eos_token_ids: list[int] = _ids(cfg.get("eos_token_ids"))
        self.chat_template: str | None = cfg.get("chat_template")
        self.has_chat_template: bool = bool(self.chat_template)
        self._template: Any = None
        if self.chat_template:
            try:
                self._template = _compile_chat_template(self.chat_template)
            except Exception as e:
                raise _err(self.folder / CONFIG_FILE, f"the chat template does not compile: {e}") from e

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. With ``add_special_tokens`` the tokenizer's post-processor runs
        and, if the config says ``add_bos_token``, a missing bos is prepended."""
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids.insert(0, self.bos_token_id)
        return ids

    def apply_chat_template(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, system: str | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for ``messages`` ([{"role", "content"}, ...]). ``system`` becomes a system
        message at the head (replacing the content of one already there); ``tools``: the template's
        ``tools`` variable (function definitions, Hugging Face's shape)."""
        if self._template is None:
            raise _err(self.folder, "the bundled tokenizer has no chat template")
        msgs = [dict(m) for m in messages]
        if system is not None:
            if msgs and msgs[0].get("role") == "system":
                msgs[0]["content"] = system
            else:
                msgs.insert(0, {"role": "system", "content": system})
        import jinja2

        try:
            return str(
                self._template.render(
                    messages=msgs,
                    tools=tools,
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self.bos_token,
                    eos_token=self.eos_token,
                    pad_token=self.pad_token,
                )
            )
        except jinja2.TemplateError as e:
            raise ZlcError(" ".join(f"chat template: {e}".split())) from e

    def encode_chat(self, messages: list[dict[str, Any]] | str) -> list[int]:
        """Prompt ids for a chat (a str is one user message), generation prompt added; the template
        supplies any special tokens (like transformers' ``apply_chat_template(tokenize=True)``).
        Without a chat template: the plain encoding of the text (message contents joined by newlines)."""
        if isinstance(messages, str):
            if self._template is None:
                return self.encode(messages)
            messages = [{"role": "user", "content": messages}]
        if self._template is None:
            return self.encode("\n".join(_content_text(m.get("content")) for m in messages))
        return self.encode(self.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def stream_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self._tok, skip_special_tokens=skip_special_tokens)


class IncrementalDecoder:
    """Streaming detokenization: :meth:`feed` one token id at a time and get the text that is now
    stable; :meth:`flush` at the end. The pieces concatenate to ``decode(all ids)``.

    Text is decoded over a short window of recent tokens (the last emitted chunk for context, then
    the pending tokens), so per-token cost stays flat. A window whose text ends in U+FFFD (an
    incomplete UTF-8 sequence from byte-level or byte-fallback tokens) is held back until the
    character completes, or until :meth:`flush`.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start: the tokens of the last emitted chunk begin here
        self._read = 0  # tokens before this have been emitted

    def _decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=self.skip_special_tokens))

    def feed(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        if len(text) <= len(prefix_text) or text.endswith(_REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(prefix_text):]

    def flush(self) -> str:
        """Everything not yet emitted (an incomplete trailing sequence decodes as U+FFFD)."""
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return text[len(prefix_text):]
