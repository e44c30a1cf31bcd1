"""A model directory's tokenizer for the router's tests: a word-level vocabulary of
the tiny model's size and a chat template, written with the `tokenizers` package
(vLLM's OpenAI server and the router both load it with transformers)."""

from __future__ import annotations

import json
from pathlib import Path

ROLES = ("system:", "user:", "assistant:")
SPECIALS = ("[UNK]", "<s>", "</s>")
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def words(vocab: int) -> list[str]:
    """The plain words of the vocabulary, in id order."""
    return [f"w{i}" for i in range(vocab - len(SPECIALS) - len(ROLES))]


def write_tokenizer(directory: Path, vocab: int) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokens = [*SPECIALS, *ROLES, *words(vocab)]
    model = models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="[UNK]")
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(list(SPECIALS))
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "[UNK]",
        "model_max_length": 8192,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return directory
