"""A request's prompt as the engines see it: the model's tokenizer and chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtier.hashing import hash_request_blocks
from kvtier.router.prompts import PromptError, PromptHasher
from kvtier.vllm.engines.tokenizer import write_tokenizer
from tests.vllm.needs_vllm import require_vllm

VOCAB = 64


@pytest.fixture(scope="module")
def hasher(tmp_path_factory: pytest.TempPathFactory) -> PromptHasher:
    require_vllm()  # transformers comes with vLLM
    return PromptHasher(4, write_tokenizer(tmp_path_factory.mktemp("model"), VOCAB))


def test_completions_text_and_token_ids(hasher: PromptHasher) -> None:
    # ids: [UNK] <s> </s> system: user: assistant: w0 w1 ...
    assert hasher.tokens("/v1/completions", {"prompt": "w0 w1 nope user:"}) == [6, 7, 0, 4]
    assert hasher.tokens("/v1/completions", {"prompt": [9, 8, 7]}) == [9, 8, 7]
    assert hasher.tokens("/v1/completions", {"prompt": ["w2 w3", "w4"]}) == [8, 9]  # the first
    assert hasher.tokens("/v1/completions", {"prompt": [[5], [6]]}) == [5]


def test_chat_goes_through_the_template(hasher: PromptHasher) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "w0"},
        {"role": "assistant", "content": [{"type": "text", "text": "w1"}, {"type": "text",
                                                                              "text": "w2"}]},
    ]  # fmt: skip
    assert hasher.tokens("/v1/chat/completions", {"messages": messages}) == [4, 6, 5, 7, 8, 5]
    no_prompt = {"messages": messages, "add_generation_prompt": False}
    assert hasher.tokens("/v1/chat/completions", no_prompt) == [4, 6, 5, 7, 8]


def test_hashes_are_kvtiers_with_the_salt(hasher: PromptHasher) -> None:
    body: dict[str, Any] = {"prompt": list(range(10))}
    assert hasher.hashes("/v1/completions", body) == hash_request_blocks(list(range(10)), 4)
    salted = hasher.hashes("/v1/completions", body | {"cache_salt": "t"})
    assert (
        salted
        == hash_request_blocks(list(range(10)), 4, cache_salt="t")
        != hasher.hashes("/v1/completions", body)
    )


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/embeddings", {"input": "x"}, "no prompt"),
        ("/v1/completions", {"prompt": 3}, "text or token ids"),
        ("/v1/chat/completions", {"messages": []}, "non-empty list"),
        ("/v1/chat/completions", {"messages": ["hi"]}, "must be an object"),
    ],
)
def test_what_has_no_prompt(
    hasher: PromptHasher, path: str, body: dict[str, Any], message: str
) -> None:
    with pytest.raises(PromptError, match=message):
        hasher.tokens(path, body)


def test_text_without_a_model_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PromptError, match="model directory"):
        PromptHasher(4).tokens("/v1/completions", {"prompt": "w0"})
    assert PromptHasher(4).tokens("/v1/completions", {"prompt": [1, 2]}) == [1, 2]
