"""A request's block hashes exactly as the engines compute them.

vLLM hashes a request's full blocks with its prefix-caching hash: the engines must
run with `--prefix-caching-hash-algo sha256_cbor` (vLLM's default `sha256` pickles,
which nothing outside Python reproduces), the same block size, and the same seed for
the chain's root (the engine's PYTHONHASHSEED, or "vllm-none-hash" when unset).
kvtier's hashing is byte-identical to that scheme; a request's `cache_salt` goes in.

Text is tokenized with the model's own tokenizer from its local directory, as
vLLM's OpenAI server does: a completion's prompt with special tokens (vLLM's
default `add_special_tokens=True`), a chat rendered by the tokenizer's chat template
with the generation prompt, then tokenized without special tokens (the template
holds them). A prompt the router cannot tokenize is routed cold, never refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvtier.hashing import BlockHashSpec, hash_blocks, hash_object, none_hash
from kvtier.types import BlockHash
from kvtier.validate import positive_int


class PromptError(ValueError):
    """The request body does not say what the prompt is."""


class PromptHasher:
    def __init__(
        self, block_size: int, model_dir: str | Path | None = None, hash_seed: str | None = None
    ) -> None:
        self.block_size = positive_int("block_size", block_size)
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self._root = hash_object(hash_seed) if hash_seed is not None else none_hash()
        self._tokenizer: Any = None

    def hashes(self, path: str, body: dict[str, Any]) -> list[BlockHash]:
        """The full blocks' hashes of the prompt of a request to `path` with JSON `body`."""
        return self.hashes_of(self.tokens(path, body), body)

    def hashes_of(self, tokens: list[int], body: dict[str, Any]) -> list[BlockHash]:
        """The hashes of a prompt's tokens, with the body's `cache_salt` (if any)."""
        salt = body.get("cache_salt")
        spec = BlockHashSpec(self.block_size, cache_salt=salt if isinstance(salt, str) else None)
        return hash_blocks(spec, tokens, self._root, 0)

    def tokens(self, path: str, body: dict[str, Any]) -> list[int]:
        if path.endswith("/chat/completions"):
            return self._chat_tokens(body)
        if path.endswith("/completions"):
            return self._completion_tokens(body)
        raise PromptError(f"no prompt in a request to {path}")

    def _completion_tokens(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        # a batch is routed by its first prompt (the whole batch goes to one engine)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
            prompt = prompt[0]
        if isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return prompt
        if not isinstance(prompt, str):
            raise PromptError(f"prompt must be text or token ids, got {type(prompt).__name__}")
        special = bool(body.get("add_special_tokens", True))
        return list(self._load().encode(prompt, add_special_tokens=special))

    def _chat_tokens(self, body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise PromptError("messages must be a non-empty list")
        tokenizer = self._load()
        text = tokenizer.apply_chat_template(
            [_flat(m) for m in messages],
            chat_template=body.get("chat_template"),
            tokenize=False,
            add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            continue_final_message=bool(body.get("continue_final_message", False)),
            **(body.get("chat_template_kwargs") or {}),
        )
        special = bool(body.get("add_special_tokens", False))
        return list(tokenizer.encode(text, add_special_tokens=special))

    def _load(self) -> Any:
        if self._tokenizer is None:
            if self.model_dir is None:
                raise PromptError("text prompts need the model directory (its tokenizer)")
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        return self._tokenizer


def _flat(message: Any) -> dict[str, Any]:
    """A message with text parts joined by newlines, as vLLM gives "string" templates."""
    if not isinstance(message, dict):
        raise PromptError(f"a message must be an object, got {type(message).__name__}")
    content = message.get("content")
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict)]
        return {**message, "content": "\n".join(texts)}
    return message
