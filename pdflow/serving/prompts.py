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
from concurrent.futures import ThreadPoolExecutor

from pdflow.serving.openai_protocol import ApiError, ChatCompletionRequest, CompletionRequest


def _max_token_bytes(tokenizer) -> int:
    """The most bytes of text any one token stands for (special tokens included)."""
    longest = 1
    for token in tokenizer.get_vocab():
        text = tokenizer.convert_tokens_to_string([token])
        longest = max(longest, len(text.encode("utf-8", "surrogatepass")))
    return longest


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
        self._check_bound([m["content"] for m in messages], "messages")
        return await self._run(self._chat_ids, messages)

    async def completion(self, req: CompletionRequest) -> list[int]:
        prompt = req.prompt
        if isinstance(prompt, list):
            if any(t >= self.vocab for t in prompt):
                raise ApiError(f"prompt: token ids must be in [0, {self.vocab})", param="prompt")
            return list(prompt)
        self._check_bound([prompt], "prompt")
        return await self._run(self.tokenizer.encode, prompt)

    def _chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        return list(ids)

    async def _run(self, fn, arg) -> list[int]:
        return list(await asyncio.get_running_loop().run_in_executor(self._pool, fn, arg))
