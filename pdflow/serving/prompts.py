"""From a validated request to prompt token ids: a cheap bound first, then the chat template and
the tokenizer on a worker thread, so that no prompt, however large, stalls ingress's event loop
(its heartbeats, its other requests' streams).

The bound: no token covers more than :attr:`PromptBuilder.max_token_bytes` bytes of text, so a
text of ``n`` bytes has at least ``n / max_token_bytes`` tokens. A prompt whose bound already
exceeds the model's context is refused before any templating or tokenizing.
"""

from __future__ import annotations

import asyncio
import math
from functools import partial
from concurrent.futures import ThreadPoolExecutor

from pdflow.serving.openai_protocol import ApiError, ChatCompletionRequest, Prompt


def _max_token_bytes(tokenizer) -> int:
    """The most bytes of text any one token stands for (special tokens included)."""
    token_texts = getattr(tokenizer, "token_texts", None)  # (the lean tokenizer's, a third of the time)
    if token_texts is not None:
        texts = token_texts()
    else:
        texts = (tokenizer.convert_tokens_to_string([token]) for token in tokenizer.get_vocab())
    return max((len(text.encode("utf-8", "surrogatepass")) for text in texts), default=1) or 1


class PromptBuilder:
    """Tokenizes on one worker thread (a tokenizer is not shared between threads)."""

    def __init__(self, tokenizer, max_context: int, max_messages: int = 4096):
        self.tokenizer, self.max_context, self.max_messages = tokenizer, max_context, max_messages
        self.vocab = len(tokenizer)
        self.max_token_bytes = _max_token_bytes(tokenizer)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def fewest_tokens(self, texts) -> int:
        """A lower bound on how many tokens ``texts`` make (cheap: their lengths only)."""
        return math.ceil(sum(len(t.encode("utf-8", "surrogatepass")) for t in texts) / self.max_token_bytes)

    def _check_bound(self, texts, param: str) -> None:
        fewest = self.fewest_tokens(texts)
        if fewest >= self.max_context:
            raise ApiError(f"{param}: the prompt has at least {fewest} tokens; the model's context is "
                           f"{self.max_context} tokens", param=param, code="context_length_exceeded")

    async def chat(self, req: ChatCompletionRequest) -> list[int]:
        messages = req.template_messages()
        if len(messages) > self.max_messages:
            raise ApiError(f"messages: {len(messages)} messages; this server takes at most {self.max_messages} "
                           "(server.max_messages)", param="messages")
        return await self.chat_messages(messages)

    async def chat_messages(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """The ids of templated messages (``{"role", "content"}``)."""
        self._check_bound([m["content"] for m in messages], "messages")
        return await self._run(self._chat_ids, messages, add_generation_prompt)

    async def completion(self, prompt: Prompt, param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        """One prompt's ids: text tokenized, token ids checked against the vocabulary."""
        if isinstance(prompt, list):
            self.check_ids(prompt, param)
            return list(prompt)
        self._check_bound([prompt], param)
        return await self._run(partial(self.tokenizer.encode, add_special_tokens=add_special_tokens), prompt)

    async def completion_ids(self, prompt: Prompt, param: str = "prompt") -> list[int]:
        """One prompt's ids to complete: at least one (a text of control characters alone has none)."""
        ids = await self.completion(prompt, param)
        if not ids:
            raise ApiError(f"{param}: the prompt has no tokens (its text is dropped by the tokenizer)", param=param)
        return ids

    def check_ids(self, ids: list[int], param: str) -> None:
        if any(t >= self.vocab for t in ids):
            raise ApiError(f"{param}: token ids must be in [0, {self.vocab})", param=param)

    async def text(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of token ids (checked against the vocabulary first)."""
        self.check_ids(ids, "tokens")
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, partial(self.tokenizer.decode, skip_special_tokens=skip_special_tokens), ids)

    def _chat_ids(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 tokenize=True, return_dict=False)
        return list(ids)

    async def _run(self, fn, *args) -> list[int]:
        return list(await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args))
