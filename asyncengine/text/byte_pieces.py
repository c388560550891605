"""Each token's bytes, for tokenizers whose decoder is byte-level BPE alone (GPT-2 style:
SmolLM2, Llama 3, Qwen2/3, Mistral's Tekken...), so that incremental detokenization is a
table lookup and a UTF-8 decode instead of a call into ``DecodeStream``.

Byte-level decoding is concatenative: the text of a token sequence is the UTF-8 decoding
(with U+FFFD for bad bytes) of its tokens' bytes laid end to end. A token's bytes are its
vocabulary string mapped back through GPT-2's byte-to-character table; a token holding a
character outside that table (an added token such as ``<|im_start|>`` may) is taken as its
own UTF-8 bytes, as the ``tokenizers`` decoder does. Special tokens are dropped when
``skip_special_tokens``.

The table is built from the vocabulary once per tokenizer and checked against the
tokenizer's own decoding of every added token and of a spread of ordinary ones; any
disagreement, or a decoder other than a lone ``ByteLevel``, means None: the detokenizer then
keeps ``DecodeStream``.
"""

from __future__ import annotations

from typing import Any

_CHECKED = 2048  # ordinary tokens checked against the tokenizer, spread over the vocabulary


def _translation() -> dict[int, str]:
    """GPT-2's byte-to-character table, inverted for ``str.translate``: each standing-in
    character becomes the Latin-1 character of its byte, and every other character below 256
    becomes one that Latin-1 cannot encode (so a token holding it is taken as UTF-8)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + n
            n += 1
    table = {c: "\U0010ffff" for c in range(256)}
    table.update({c: chr(b) for b, c in chars.items()})
    return table


def build_byte_pieces(backend: Any, skip_special_tokens: bool) -> list[bytes] | None:
    """The bytes of every token id of ``backend`` (a ``tokenizers.Tokenizer``), or None when
    its decoding is not plain byte-level BPE."""
    decoder = getattr(backend, "decoder", None)
    if decoder is None or type(decoder).__name__ != "ByteLevel":
        return None
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    added = backend.get_added_tokens_decoder()  # id -> AddedToken
    specials = {i for i, t in added.items() if t.special}
    table = _translation()
    pieces: list[bytes] = [b""] * vocab_size
    for token, i in backend.get_vocab(with_added_tokens=True).items():
        if not 0 <= i < vocab_size:
            return None
        if skip_special_tokens and i in specials:
            continue
        try:
            pieces[i] = token.translate(table).encode("latin-1")
        except UnicodeEncodeError:  # not all standing-in characters: the token's own UTF-8
            pieces[i] = token.encode("utf-8")
    step = max(1, vocab_size // _CHECKED)
    checked = sorted({*range(0, vocab_size, step), *(i for i in added if 0 <= i < vocab_size)})
    texts = backend.decode_batch([[i] for i in checked], skip_special_tokens=skip_special_tokens)
    for i, text in zip(checked, texts, strict=True):
        mine = pieces[i].decode("utf-8", "replace")
        if mine != text:
            return None
    return pieces
