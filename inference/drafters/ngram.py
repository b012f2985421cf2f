"""Prompt lookup: continuations copied from earlier in the sequence where its last few tokens
occurred before.

The index maps every n-gram (min_ngram <= n <= max_ngram) of the sequence so far to the positions
that followed it, and grows by one token at a time, so a lookup costs the same at token 10 and at
token 4,000. A lookup tries the longest suffix first and returns up to `branches` distinct
continuations, most recent occurrence first; the match length goes with each, since a longer match
predicts the copy better.
"""

from __future__ import annotations

from dataclasses import dataclass

# occurrences of one n-gram looked at per lookup (a long run of one repeated token has thousands)
SCAN = 64


@dataclass
class Continuation:
    tokens: list[int]  # the proposed next tokens, in order
    match: int  # how many tokens of the sequence's suffix matched where it was copied from


class NgramIndex:
    def __init__(self, min_ngram: int, max_ngram: int):
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.tokens: list[int] = []
        # n-gram -> positions right after its occurrences
        self.follows: dict[tuple[int, ...], list[int]] = {}

    def reset(self, tokens: list[int]) -> None:
        self.tokens, self.follows = [], {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            end = len(self.tokens)
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self.follows.setdefault(tuple(self.tokens[end - n : end]), []).append(end)

    def lookup(self, extra: list[int], max_tokens: int, branches: int) -> list[Continuation]:
        """Continuations of the sequence followed by `extra` (tokens not yet in the index, e.g. the
        root)."""
        seq = self.tokens + extra
        end = len(seq)
        out: list[Continuation] = []
        seen: set[tuple[int, ...]] = set()
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            for start in self.follows.get(tuple(seq[end - n :]), ())[::-1][:SCAN]:
                if start >= end:
                    continue  # the suffix itself
                cont = tuple(seq[start : start + max_tokens])
                if cont and not any(s[: len(cont)] == cont for s in seen):
                    seen.add(cont)
                    out.append(Continuation(list(cont), n))
                    if len(out) == branches:
                        return out
        return out
