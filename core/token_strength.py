"""How guessable an admin token is: an entropy estimate in bits, not just its length.

Length alone let ``'a' * 40`` or ``'passwordpasswordpassword12345678'`` through. The estimate
here is the cost of writing the token down once what is predictable in it is taken out (a
small compressor's view, in the spirit of zxcvbn without its dictionaries):

- each character that starts nothing predictable costs ``log2`` of the pool it is drawn from,
  the size of the character classes the token uses (26 lower case, 26 upper case, 10 digits,
  33 ASCII punctuation and space, 128 for anything else);
- a stretch of three or more characters that repeats what came before (``passwordpassword``,
  ``aaaa``, ``abcabc``) costs only a pointer to it: ``log2`` of where it starts and of its
  length;
- a character that continues a run of equal steps (``1234``, ``abcd``, ``9876``) costs 1 bit.

It overestimates random-looking human choices (a dictionary word costs what random letters
do); what it refuses is repetition and runs. ``secrets.token_urlsafe(32)`` (what ``make .env``
writes) scores about 250 bits, well above :data:`MIN_ADMIN_TOKEN_BITS`.
"""

from __future__ import annotations

import math
import string

# The least an admin token's estimate may be: a guessing attack's usual 128-bit target.
MIN_ADMIN_TOKEN_BITS = 128
# A repeat shorter than this is cheaper written out character by character.
MIN_REPEAT = 3
_CLASSES = (
    (frozenset(string.ascii_lowercase), 26),
    (frozenset(string.ascii_uppercase), 26),
    (frozenset(string.digits), 10),
    (frozenset(string.punctuation + " "), 33),
)
_OTHER_POOL = 128


def pool_size(token: str) -> int:
    """The size of the character classes ``token`` draws from (at least 1)."""
    chars = set(token)
    size = sum(n for members, n in _CLASSES if chars & members)
    if any(not any(c in members for members, _ in _CLASSES) for c in chars):
        size += _OTHER_POOL
    return max(size, 1)


def _longest_repeat(token: str, at: int) -> int:
    """The length of the longest stretch starting at ``at`` that repeats one starting
    earlier (it may run into itself: ``aaaa`` is ``a`` and a repeat of length 3)."""
    best = 0
    for start in range(at):
        length = 0
        while at + length < len(token) and token[start + length] == token[at + length]:
            length += 1
        best = max(best, length)
    return best


def _continues_run(token: str, at: int) -> bool:
    """``token[at]`` continues a run of equal steps of at most 1 (``123``, ``cba``, ``zzz``)."""
    if at < 2:
        return False
    step = ord(token[at]) - ord(token[at - 1])
    return abs(step) <= 1 and step == ord(token[at - 1]) - ord(token[at - 2])


def estimate_bits(token: str) -> float:
    """The token's entropy estimate in bits (see the module docstring)."""
    literal = math.log2(pool_size(token))
    bits = 0.0
    at = 0
    while at < len(token):
        repeat = _longest_repeat(token, at)
        if repeat >= MIN_REPEAT:
            bits += math.log2(at + 1) + math.log2(repeat + 1)
            at += repeat
            continue
        bits += 1.0 if _continues_run(token, at) else literal
        at += 1
    return bits


def weakness(token: str) -> str | None:
    """Why ``token`` is too guessable for an admin token, without quoting it; None when its
    estimate reaches :data:`MIN_ADMIN_TOKEN_BITS`."""
    bits = estimate_bits(token)
    if bits >= MIN_ADMIN_TOKEN_BITS:
        return None
    return (
        f"is too predictable: about {int(bits)} bits of entropy estimated, at least "
        f"{MIN_ADMIN_TOKEN_BITS} expected (repeats such as 'aaaa' or 'abcabc' and runs such "
        "as '1234' count for little); generate one with "
        "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"
    )
