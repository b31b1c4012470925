"""Chat messages to prompt token ids, without letting one big prompt stall the ingress.

Two guards, both before a prompt can block the event loop:

- **A length bound before tokenizing.** No token covers more than ``max_token_bytes`` bytes of
  text (the longest entry of the vocabulary, in UTF-8), so a text of B bytes is at least
  B / max_token_bytes tokens; a text that cannot fit the context even so is refused at once, with
  the same "prompt is too long" error tokenizing would give. A factor of slack covers normalizers
  that shrink text (NFKC folds a 3-byte full-width letter into 1 byte).
- **Big prompts are tokenized on a thread.** ``tokenizers`` holds the GIL in ``encode`` but
  releases it in ``encode_batch``, so a prompt over ``THREAD_BYTES`` is encoded as a batch of one
  in the loop's executor while the loop goes on serving (health checks, other streams).

The ids are the bundle tokenizer's own: the chat template rendered by it, the text encoded without
special tokens (the template carries them) by a second ``tokenizers.Tokenizer`` over the same
tokenizer.json, which is exactly what ``BundleTokenizer.encode_chat`` does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from zlc.errors import ZlcError

from .api_common import ApiError, ChatPrompt, invalid
from .tools import render_args

THREAD_BYTES = 64 * 1024
NORMALIZER_SLACK = 4


class PromptEncoder:
    def __init__(self, tokenizer: Any, max_seq: int, model_vocab: int | None = None):
        """`model_vocab`: the model's vocabulary size (token-id prompts are checked against it here,
        not in the engine)."""
        from tokenizers import Tokenizer

        from zlc.runtime.tokenizer import TOKENIZER_FILE

        self.tokenizer = tokenizer
        self.max_seq = max_seq
        self.model_vocab = model_vocab
        self._fast = Tokenizer.from_file(str(tokenizer.folder / TOKENIZER_FILE))
        vocab = self._fast.get_vocab(with_added_tokens=True)
        self.max_token_bytes = max((len(t.encode()) for t in vocab), default=1) or 1

    def texts(self, prompt: ChatPrompt) -> list[str] | None:
        """The strings whose plain encodings, concatenated, are the prompt; None for a tokenizer
        without a chat template (then encode_chat adds special tokens its own way) and for a
        completion's text (encoded with the tokenizer's special tokens)."""
        tok = self.tokenizer
        if prompt.text is not None:
            return None
        if not tok.has_chat_template:
            if prompt.tools is not None and prompt.tools.offered or any(
                    m["role"] == "tool" or m.get("tool_calls") for m in prompt.chat):
                raise invalid("tools: this bundle's tokenizer has no chat template, so tools and tool turns have no "
                              "format to be rendered in (compile with a tokenizer that has one)", "tools")
            if prompt.prefill is not None:
                raise invalid("a final assistant message (prefill) needs a chat template, and this bundle's "
                              "tokenizer has none")
            return None
        try:
            if prompt.prefill is None:
                return [self.render(prompt)]
            head = [self.render(prompt)] if prompt.chat else []
            return head + [prompt.prefill.rstrip()]
        except ZlcError as e:  # the model's template refused the conversation (roles must alternate...)
            raise invalid(str(e)) from None

    def render(self, prompt: ChatPrompt) -> str:
        """The chat (and its tools: tools.render_args, in the template's format or the default) through
        the template, generation prompt added."""
        messages, tools = render_args(prompt.chat, prompt.tools, self.tokenizer.chat_template)
        return str(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools))

    def check_size(self, prompt: ChatPrompt, texts: list[str] | None) -> int:
        """The prompt's text bytes; the "too long" error if no tokenization could fit them."""
        if texts is None:
            texts = [prompt.text] if prompt.text is not None else [m["content"] or "" for m in prompt.chat]
        n = sum(len(t.encode()) for t in texts)
        at_least = n // (self.max_token_bytes * NORMALIZER_SLACK)
        if at_least > self.max_seq:
            raise invalid(f"prompt is too long: {n} bytes of text are at least {at_least} tokens > {self.max_seq} "
                          "maximum")
        return n

    def encode(self, prompt: ChatPrompt, texts: list[str] | None, *, release_gil: bool = False) -> list[int]:
        if prompt.text is not None:
            return list(self.tokenizer.encode(prompt.text))
        if texts is None:
            return list(self.tokenizer.encode_chat(prompt.chat))
        if release_gil:
            encs = self._fast.encode_batch(texts, add_special_tokens=False)
        else:
            encs = [self._fast.encode(t, add_special_tokens=False) for t in texts]
        ids: list[int] = []
        for e in encs:
            ids += e.ids
        return ids

    def prompt_ids(self, prompt: ChatPrompt, done: Callable[[list[int] | ApiError], None]) -> None:
        """Calls `done(ids)` (or `done(error)`): at once for a small prompt, from the loop after a
        thread has encoded a big one."""
        if prompt.ids is not None:  # token ids, as they are
            limit = self.model_vocab
            bad = next((t for t in prompt.ids if limit is not None and t >= limit), None)
            if bad is not None and limit is not None:
                return done(invalid(f"prompt: token id {bad} is outside the vocabulary (0..{limit - 1})", "prompt"))
            return done(list(prompt.ids))
        try:
            texts = self.texts(prompt)
            size = self.check_size(prompt, texts)
        except ApiError as e:
            return done(e)
        if size < THREAD_BYTES:
            return done(self.encode(prompt, texts))
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(None, lambda: self.encode(prompt, texts, release_gil=True))
        fut.add_done_callback(lambda f: done(f.result() if f.exception() is None else
                                             ApiError("api_error", f"tokenizing failed: {f.exception()}")))
