"""Fill-in-the-middle prompts, for llama-server's ``/infill`` (code completion in editors) and
OpenAI's ``suffix`` (insertion).

A code model trained for it marks the code before the cursor, the code after it and where to
write with special tokens, in prefix-suffix-middle order: ``PRE prefix SUF suffix MID``, the
model then writing the middle. Models name those tokens in one of a few ways, found in the
tokenizer's vocabulary by their text:

- Qwen2.5/3-Coder, CodeGemma: ``<|fim_prefix|>``, ``<|fim_suffix|>``, ``<|fim_middle|>``,
  and for other files of the project ``<|repo_name|>``, ``<|file_sep|>``;
- StarCoder 1 and 2: ``<fim_prefix>``, ``<fim_suffix>``, ``<fim_middle>``, ``<repo_name>``,
  ``<file_sep>``;
- DeepSeek-Coder: ``<｜fim▁begin｜>``, ``<｜fim▁hole｜>``, ``<｜fim▁end｜>``;
- CodeLlama: ``<PRE>``, ``<SUF>``, ``<MID>``.

``infill_prompt`` builds the tokens llama-server builds for ``/infill``, so that an editor
gets the completions it got there: other files first, as the repository-level pattern the
models were trained on (``REPO myproject\n SEP name\n text ... SEP filename\n``; without
those tokens each file's text after a ``--- snippet ---`` line), then the optional BOS, then
``PRE prefix prompt SUF suffix MID`` (``prompt``, the typed start of the cursor's line, ends
the prefix). It fits the prompt to the context as llama-server does: of a batch of ``n_batch``
tokens the prefix keeps its last 3/4, the suffix its first 1/4 less the prompt, and the other
files the last ``n_ctx - n_batch - 2 n_predict`` tokens of theirs (none when the context is
no larger than the batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

#: (prefix, suffix, middle, repository, file separator) token texts, by model family.
STYLES: tuple[tuple[str, str, str, str | None, str | None], ...] = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<repo_name>", "<file_sep>"),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", None, None),
    ("<PRE>", "<SUF>", "<MID>", None, None),
)


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    repo: int | None = None
    file_sep: int | None = None


def fim_tokens(vocab: dict[str, int]) -> FimTokens | None:
    """The model's fill-in-the-middle tokens (``vocab``: token text -> id), None without."""
    for pre, suf, mid, repo, sep in STYLES:
        if pre in vocab and suf in vocab and mid in vocab:
            repo_id = vocab.get(repo) if repo else None
            sep_id = vocab.get(sep) if sep else None
            if repo_id is None or sep_id is None:
                repo_id = sep_id = None
            return FimTokens(vocab[pre], vocab[suf], vocab[mid], repo_id, sep_id)
    return None


_FOUND: WeakKeyDictionary = WeakKeyDictionary()  # tokenizer -> its FimTokens (or None)


def tokenizer_fim_tokens(tokenizer: Any) -> FimTokens | None:
    """``fim_tokens`` of a ``text.tokenizer.Tokenizer``'s vocabulary, looked up once."""
    if tokenizer not in _FOUND:
        _FOUND[tokenizer] = fim_tokens(tokenizer.hf.get_vocab())
    return _FOUND[tokenizer]


def fim_prompt(tokens: FimTokens, encode: Any, prefix: str | list[int], suffix: str,
               middle: str = "",
               extra: Sequence[tuple[str, str]] = (), bos: Sequence[int] = (),
               project: str = "myproject") -> list[int]:
    """The token ids of a fill-in-the-middle prompt. ``encode(text)``: ids without special
    tokens; ``prefix``: text or token ids; ``middle``: the start of the middle, already
    written; ``extra``: other files' ``(name, text)``; ``bos``: what the tokenizer puts
    first."""
    ids = list(bos)
    if extra and tokens.repo is not None and tokens.file_sep is not None:
        ids += [tokens.repo, *encode(project + "\n")]
        for name, text in extra:
            ids += [tokens.file_sep, *encode(f"{name}\n{text}")]
        ids.append(tokens.file_sep)
    else:
        for _, text in extra:
            ids += encode(text)
    head = prefix if isinstance(prefix, list) else encode(prefix)
    ids += [tokens.prefix, *head, tokens.suffix, *encode(suffix), tokens.middle]
    return ids + encode(middle) if middle else ids


#: What separates other files' text where the model has no file-separator token.
SNIPPET = "\n\n--- snippet ---\n\n"


def infill_prompt(tokens: FimTokens, encode: Any, prefix: str, suffix: str, prompt: str = "",
                  extra: Sequence[tuple[str, str]] = (), bos: Sequence[int] = (), *,
                  n_batch: int, n_ctx: int, n_predict: int = -1,
                  project: str = "myproject") -> list[int]:
    """The token ids of llama-server's ``/infill`` prompt (see the module doc), fitted to
    ``n_batch`` (the prefix and suffix) and ``n_ctx`` (the other files) with ``n_predict``
    tokens to come (-1: unbounded, as llama-server counts it). ``encode(text)``: ids without
    special tokens; ``extra``: other files' ``(name, text)``."""
    other: list[int] = []
    if tokens.repo is not None:
        other += [tokens.repo, *encode(project + "\n")]
    for name, text in extra:
        if tokens.file_sep is not None:
            other += [tokens.file_sep, *encode((name or "tmp") + "\n")]
        else:
            other += encode(SNIPPET)
        other += encode(text)
    if tokens.file_sep is not None:
        other += [tokens.file_sep, *encode("filename\n")]
    head, tail, typed = encode(prefix), encode(suffix), encode(prompt) if prompt else []
    take_head = min(len(head), 3 * (n_batch // 4))
    take_tail = min(len(tail), max(0, n_batch // 4 - (2 + len(typed))))
    take_other = min(max(0, n_ctx - n_batch - 2 * n_predict), len(other))
    return [*other[len(other) - take_other:], *bos, tokens.prefix,
            *head[len(head) - take_head:], *typed, tokens.suffix, *tail[:take_tail],
            tokens.middle]
