"""A stream's text, decoded a few tokens at a time: the work per token is bounded, and the text
and its pieces are what decoding the whole output at every token gave, stop strings included."""

from __future__ import annotations

import random
from typing import Any

import pytest

from hicache.models.byte_tokenizer import ByteTokenizer
from hicache.server.answers import TextStream

PARTIAL = "\ufffd"


class WholeDecodeStream:
    """The stream as it was before: the whole output decoded at every token (the reference)."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...]) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.tokens: list[int] = []
        self.text, self.stopped = "", False

    def push(self, token: int) -> str:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.stopped = True
            return self.show(text, max(min(cuts), len(self.text)))
        safe = len(text) - self.hold
        while safe > len(self.text) and text[safe - 1] == PARTIAL:
            safe -= 1
        return self.show(text, safe)

    def flush(self) -> str:
        if self.stopped or not self.tokens:
            return ""
        return self.show(self.tokenizer.decode(self.tokens), None)

    def show(self, text: str, end: int | None) -> str:
        new = text[len(self.text) : end]
        self.text += new
        return new


class CountingTokenizer:
    """A tokenizer that counts the token ids it is asked to decode."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.decoded = inner, 0

    def decode(self, ids: list[int]) -> str:
        self.decoded += len(ids)
        return str(self.inner.decode(ids))


def pieces(stream: Any, tokens: list[int]) -> list[str]:
    out = []
    for token in tokens:
        out.append(stream.push(token))
        if stream.stopped:
            return out
    return [*out, stream.flush()]


def utf8_mess(rng: random.Random, n: int) -> list[int]:
    """Bytes that split characters of 1 to 4 bytes across tokens, with stray and truncated
    sequences, runs of invalid bytes and U+FFFD itself among them."""
    out: list[int] = []
    while len(out) < n:
        kind = rng.random()
        if kind < 0.5:
            out += chr(rng.choice([0x61, 0x20, 0xE9, 0x65E5, 0x1F389, 0xFFFD])).encode()
        elif kind < 0.7:
            out += chr(rng.choice([0xE9, 0x65E5, 0x1F389])).encode()[: rng.randint(1, 3)]
        elif kind < 0.85:
            out += [rng.choice([0x80, 0xBF, 0xC0, 0xFF, 0xF8])] * rng.randint(1, 12)
        else:
            out.append(rng.randrange(256))
    return out[:n]


def byte_level_bpe() -> Any:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator([CORPUS] * 4, trainer)
    return tokenizer


def sentencepiece_bpe() -> Any:
    """Spaces as ``▁``, the first token's leading space dropped in decoding."""
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.SentencePieceBPETokenizer()
    tokenizer.train_from_iterator([CORPUS] * 4, vocab_size=300, show_progress=False)
    return tokenizer


CORPUS = "the cat sat on the mat, café crème 日本語のテキスト 🎉🎉 naïve façade " * 8


def test_decoding_work_per_token_is_bounded() -> None:
    rng = random.Random(1)
    n = 3000
    for tokens in ([ord("a")] * n, [0xFF] * n, [0xE6] * n, utf8_mess(rng, n)):
        counting = CountingTokenizer(ByteTokenizer())
        stream = TextStream(counting, ("zzz",))
        text = "".join(pieces(stream, tokens))
        assert text == ByteTokenizer().decode(tokens)
        # A few windows of a few tokens a token (3 for text, 14 for a run of U+FFFD); decoding
        # the whole output at every token was n * n / 2 = 1500 a token here.
        assert counting.decoded <= 20 * n, counting.decoded


@pytest.mark.parametrize("seed", range(40))
def test_utf8_bytes_give_the_pieces_of_a_whole_decode(seed: int) -> None:
    rng = random.Random(seed)
    tokens = utf8_mess(rng, rng.randint(1, 400))
    whole = ByteTokenizer().decode(tokens)
    for stops in ((), (whole[-5:-2] or "x",), ("\ufffd\ufffd", "é"), ("a" * 6, "日")):
        want = pieces(WholeDecodeStream(ByteTokenizer(), stops), tokens)
        assert pieces(TextStream(ByteTokenizer(), stops), tokens) == want, (tokens, stops)


def test_tokenizers_vocabularies_give_the_text_of_a_whole_decode() -> None:
    for tokenizer in (byte_level_bpe(), sentencepiece_bpe()):
        rng = random.Random(7)
        vocab = tokenizer.get_vocab_size()
        encoded = tokenizer.encode(CORPUS).ids
        for tokens in (encoded, [rng.randrange(vocab) for _ in range(600)]):
            whole = tokenizer.decode(tokens)
            assert "".join(pieces(TextStream(tokenizer, ()), tokens)) == whole
            for stops in (("日本",), ("ç", " the"), (whole[100:103],)):
                want = pieces(WholeDecodeStream(tokenizer, stops), tokens)
                assert pieces(TextStream(tokenizer, stops), tokens) == want


def test_a_character_split_across_tokens_waits_for_its_last_byte() -> None:
    stream = TextStream(ByteTokenizer(), ())
    got = [stream.push(b) for b in "a日🎉".encode()]
    assert got == ["a", "", "", "日", "", "", "", "🎉"]
    assert stream.flush() == ""
