"""The tokenizer: encoding, decoding, chat templates, and loading (with a disk cache for the
tokenizers converted from GGUF files).

Incremental detokenization with stop strings lives in ``detokenizer.py``, which uses this
module (never the other way round).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from asyncengine.config import environment

__all__ = ["Tokenizer", "load_tokenizer", "resolve_chat_template"]


class Tokenizer:
    """A transformers fast tokenizer with what the engine needs from it.

    ``hf`` is the transformers tokenizer; ``backend`` its ``tokenizers.Tokenizer`` (the Rust
    object the incremental detokenizer steps through).
    """

    def __init__(self, hf: Any, *, eos_token_ids: Iterable[int] = (),
                 chat_template: str | None = None) -> None:
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"tokenizer {type(hf).__name__} is not a fast (tokenizers) tokenizer")
        self.hf = hf
        self.backend = backend
        self.chat_template = chat_template
        ids = set(eos_token_ids)
        if hf.eos_token_id is not None:
            ids.add(hf.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(ids)
        self.vocab_size: int = len(hf)
        self._token_texts: dict[int, str] = {}
        self._byte_pieces: dict[bool, list[bytes] | None] = {}
        self._byte_texts: dict[bool, list[str | None] | None] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, chat_template: str | None = None,
                            **kwargs: Any) -> str:
        """Render ``messages`` to a prompt string. The template is ``chat_template`` if given,
        else the one given at load time (``--chat-template``), else the tokenizer's own.
        Extra keyword arguments (``tools``, ``continue_final_message``...) go to the template.
        """
        template = chat_template or self.chat_template or self.hf.chat_template
        if not template:
            raise ValueError("this model's tokenizer has no chat template; pass one with "
                             "--chat-template (a Jinja string or a file holding one)")
        return self.hf.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=add_generation_prompt,
            tokenize=False, **kwargs)

    def token_texts(self, ids: Iterable[int]) -> list[str]:
        """The text of each token on its own (for logprobs): byte-level pieces are decoded,
        e.g. ``"Ġthe"`` → ``" the"``; a piece of a multi-byte character decodes to U+FFFD."""
        ids = list(ids)
        cache = self._token_texts
        missing = [i for i in dict.fromkeys(ids) if i not in cache]
        if missing:
            texts = self.backend.decode_batch([[i] for i in missing], skip_special_tokens=False)
            cache.update(zip(missing, texts, strict=True))
        return [cache[i] for i in ids]

    def byte_pieces(self, skip_special_tokens: bool = True) -> list[bytes] | None:
        """Each token's bytes when decoding is plain byte-level BPE (``byte_pieces.py``), for
        the incremental detokenizer; None otherwise. Built once per tokenizer."""
        if skip_special_tokens not in self._byte_pieces:
            from asyncengine.text.byte_pieces import build_byte_pieces

            self._byte_pieces[skip_special_tokens] = build_byte_pieces(
                self.backend, skip_special_tokens)
        return self._byte_pieces[skip_special_tokens]

    def byte_texts(self, skip_special_tokens: bool = True) -> list[str | None] | None:
        """``byte_pieces`` decoded: each token's text when its bytes are whole UTF-8 characters,
        None where they are not (part of a character; the detokenizer then holds the bytes).
        The common token of a step is one table lookup. Built once per tokenizer."""
        if skip_special_tokens not in self._byte_texts:
            pieces = self.byte_pieces(skip_special_tokens)
            texts = None
            if pieces is not None:
                texts = []
                for piece in pieces:
                    text = piece.decode("utf-8", "replace")
                    texts.append(None if text.endswith("\ufffd") else text)
            self._byte_texts[skip_special_tokens] = texts
        return self._byte_texts[skip_special_tokens]

    def __repr__(self) -> str:
        return f"Tokenizer({self.hf.name_or_path!r}, vocab_size={self.vocab_size})"


# -- loading -----------------------------------------------------------------------------------

def load_tokenizer(path: str, *, gguf_file: str | None = None, revision: str | None = None,
                   chat_template: str | None = None) -> Tokenizer:
    """Load the tokenizer of a model: an HF directory or hub id (``path``), or the tokenizer
    embedded in a GGUF file (``path`` = the file, or its directory with ``gguf_file``).

    Converting a GGUF tokenizer takes seconds, so the result is saved under
    ``$ASYNCENGINE_CACHE/tokenizers`` (default ``~/.cache/asyncengine/tokenizers``), keyed by
    the file's path, size and mtime, and loaded from there afterwards.
    ``chat_template`` overrides the tokenizer's: a Jinja string or a path to a file holding one.
    """
    from transformers import AutoTokenizer

    template = resolve_chat_template(chat_template)
    if gguf_file is None and path.endswith(".gguf") and os.path.isfile(path):
        path, gguf_file = os.path.split(os.path.abspath(path))
    if gguf_file is not None:
        hf = _load_gguf_tokenizer(path, gguf_file)
    else:
        hf = AutoTokenizer.from_pretrained(path, revision=revision)
    eos = _generation_config_eos(path, revision) if gguf_file is None else ()
    return Tokenizer(hf, eos_token_ids=eos, chat_template=template)


def resolve_chat_template(chat_template: str | None) -> str | None:
    """``--chat-template``: a file holding a Jinja template, or the template itself."""
    if chat_template is None:
        return None
    if os.path.isfile(chat_template):
        return Path(chat_template).read_text(encoding="utf-8")
    if any(c in chat_template for c in "{}\n"):
        return chat_template
    raise ValueError(f"--chat-template {chat_template!r} is neither a readable file nor a "
                     "Jinja template")


def _cache_root() -> Path:
    root = environment.get("ASYNCENGINE_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "asyncengine"
    return base / "tokenizers"


def _gguf_cache_key(gguf_path: Path) -> str:
    import tokenizers
    import transformers

    st = gguf_path.stat()
    ident = (f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|"
             f"{transformers.__version__}|{tokenizers.__version__}")
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


def _load_gguf_tokenizer(directory: str, gguf_file: str) -> Any:
    from transformers import AutoTokenizer

    gguf_path = Path(directory) / gguf_file
    if not gguf_path.is_file():
        raise ValueError(f"GGUF file not found: {gguf_path}")
    cached = _cache_root() / _gguf_cache_key(gguf_path)
    if (cached / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception:  # a damaged cache entry: convert again below
            shutil.rmtree(cached, ignore_errors=True)
    hf = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=cached.parent, prefix=".tmp-")
        hf.save_pretrained(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        try:
            os.rename(tmp, cached)  # atomic: readers never see a half-written entry
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass  # an unwritable cache only costs the conversion next time
    return hf


def _generation_config_eos(path: str, revision: str | None) -> list[int]:
    """eos ids from the model's generation_config.json, if it is on the local disk."""
    file: str | None = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        file = None
        if not os.path.isdir(path):
            try:
                from huggingface_hub import try_to_load_from_cache

                found = try_to_load_from_cache(path, "generation_config.json", revision=revision)
                file = found if isinstance(found, str) else None
            except Exception:
                file = None
    if file is None:
        return []
    try:
        eos = json.loads(Path(file).read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError):
        return []
    if isinstance(eos, int):
        return [eos]
    if isinstance(eos, list):
        return [e for e in eos if isinstance(e, int)]
    return []
