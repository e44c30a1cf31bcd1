"""A word-level tokenizer for a model directory, so that vLLM's OpenAI server and the
router take text for a model with made-up weights.

Every token is one whitespace-separated word and every word one token, so lengths in
words are lengths in tokens and a token-id prompt has an exact text (`text_of`): the
same prompts go to engines by id and to a server as text. Ids 0-2 are the special
tokens, 3-5 the chat roles (the chat template's `user:` and so on, one token each), the
rest the plain words `w0`, `w1`, ... (`words`). Written with the `tokenizers` package
(which vLLM installs): vLLM and the router load it with transformers.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

SPECIALS = ("[UNK]", "<s>", "</s>")
ROLES = ("system:", "user:", "assistant:")
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def words(vocab: int) -> list[str]:
    """The plain words, in id order: what workloads draw their text from (a role or a
    special token in a message would change how the conversation is read)."""
    return [f"w{i}" for i in range(vocab - len(SPECIALS) - len(ROLES))]


def tokens(vocab: int) -> list[str]:
    """Every token by id: the tokenizer's vocabulary."""
    return [*SPECIALS, *ROLES, *words(vocab)]


def text_of(token_ids: Iterable[int], vocab: int) -> str:
    """The text that tokenizes to exactly `token_ids` (no special token added)."""
    vocabulary = tokens(vocab)
    return " ".join(vocabulary[t] for t in token_ids)


def write_tokenizer(directory: Path, vocab: int) -> Path:
    """Write the tokenizer of a `vocab`-token model into `directory`; returns it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    model = models.WordLevel({t: i for i, t in enumerate(tokens(vocab))}, unk_token="[UNK]")
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


def chat_model(source: Path, directory: Path, vocab: int) -> Path:
    """A copy of the model in `source` (its config, and its weights when it has any)
    with this tokenizer: a server started on it takes text and chat."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        if (source / name).exists():
            shutil.copy(source / name, directory / name)
    return write_tokenizer(directory, vocab)
