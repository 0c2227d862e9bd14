"""A character tokenizer for the task texts: one id per character, plus pad, BOS and EOS.

Why characters and not the corpus BPE: arithmetic and sorting are learnt digit by digit; a BPE that
merges "12" into one token hides the digits from a model of a few million parameters. The ids sit at the
bottom of the model's vocabulary, so any preset with a vocabulary of at least ``vocab_size`` can be used.
Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable

from moetrain.errors import UserError

PAD, BOS, EOS = 0, 1, 2
ALPHABET = "0123456789+-*/()=<>,.:? abcdefghijklmnopqrstuvwxyz"


class CharTokenizer:
    """``encode`` maps each character of ``ALPHABET`` to one id; ``decode`` skips pad and BOS and stops at EOS."""

    pad_id, bos_id, eos_id = PAD, BOS, EOS

    def __init__(self, alphabet: str = ALPHABET) -> None:
        assert len(set(alphabet)) == len(alphabet), "repeated characters in the alphabet"
        self.alphabet = alphabet
        self._id_of = {char: index + 3 for index, char in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet) + 3

    def encode(self, text: str) -> list[int]:
        try:
            return [self._id_of[char] for char in text]
        except KeyError as exc:
            raise UserError(f"character {exc.args[0]!r} is not in the task alphabet {self.alphabet!r}") from None

    def decode(self, ids: Iterable[int]) -> str:
        chars = []
        for token in ids:
            if token == EOS:
                break
            if token >= 3 and token - 3 < len(self.alphabet):
                chars.append(self.alphabet[token - 3])
        return "".join(chars)

    def check_fits(self, vocab_size: int, model_name: str) -> None:
        if vocab_size < self.vocab_size:
            raise UserError(f"model {model_name} has a vocabulary of {vocab_size}, fewer than the task tokenizer's "
                            f"{self.vocab_size} ids; use a model with a larger vocab_size")
