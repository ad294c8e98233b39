"""One meaning for a ``regex`` constraint, whichever backend serves it.

The two grammar backends read the same pattern differently (xgrammar 0.2.9
and llguidance 1.9.1 over a byte-level vocabulary; ``bench/regex_fuzz.py``'s
unmended rows show it):

==========  ==========================  =================================
            xgrammar                    llguidance (Rust ``regex`` syntax)
==========  ==========================  =================================
``.``       any character, ``\\n`` too    any character but ``\\n``
``\\d``      ``[0-9]``                   any Unicode digit (``١``, ``６``)
``\\w``      ``[0-9A-Za-z_]``            any Unicode word character (``é``)
``\\s``      its own set                 Unicode ``White_Space``
==========  ==========================  =================================

so ``backend: auto`` (xgrammar for a regex, llguidance where xgrammar
refuses it) could hand a client multi-line text for ``.*`` or Arabic-Indic
digits for ``\\d+``.  :func:`portable_regex` writes these four constructs out
as explicit classes with ECMA-262's meaning, the dialect of JSON Schema's
``pattern`` (which both backends already follow inside JSON): ``.`` is any
character but a line terminator (``\\n``, ``\\r``, U+2028, U+2029), ``\\d``
is ``[0-9]``, ``\\w`` is ``[0-9A-Za-z_]`` and ``\\s`` is ECMA-262's white
space and line terminators.  A JavaScript ``RegExp`` then matches every
output exactly.  Python's ``re`` and Rust's ``regex`` read ``\\d``, ``\\w``
and ``.`` more widely, so an output that uses those matches there too; not
so for the negations (``\\D`` admits ``٣``, which they call a digit) or for
U+FEFF under ``\\s`` (they do not call it white space).

A class that holds a negated shorthand becomes an alternation of classes
(``[a\\S]`` is ``(?:[a]|\\S written out)``); only a negated class that holds
one beside other members (``[^a\\S]``) is refused rather than left to each
backend's meaning.  Everything else passes through unchanged: each backend
still parses the pattern and refuses what it does not support.

Anchors: xgrammar drops a ``^`` or ``$`` inside a pattern (with a logged
warning), so ``a$b`` would admit ``ab``; llguidance reads them, or refuses
the pattern.  :func:`misplaced_anchor` finds those whose loss would admit
more, and :func:`grammar_backend.compile.compile_spec` refuses such a
pattern for xgrammar (``backend: auto`` then tries llguidance).
"""

from __future__ import annotations

from typing import Final

from grammar_backend.errors import ConstraintError

__all__ = ["misplaced_anchor", "portable_regex"]

#: ECMA-262 ``WhiteSpace`` and ``LineTerminator`` (what ``\s`` matches there), as class members:
#: tab, LF, VT, FF, CR, space, U+00A0, U+1680, U+2000-U+200A, U+2028, U+2029, U+202F, U+205F,
#: U+3000, U+FEFF.  The control characters are written as escapes both backends read.
_SPACE: Final = "\\t\\n\\x0b\\x0c\\r \u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
#: ECMA-262 line terminators: ``.`` matches any character but these.
_LINE_ENDS: Final = "\\n\\r\u2028\u2029"
#: The members each shorthand stands for inside a class.
_MEMBERS: Final = {"d": "0-9", "w": "0-9A-Za-z_", "s": _SPACE}
#: Each shorthand written out as a class of its own, outside a class.
_OUTSIDE: Final = {**{k: f"[{v}]" for k, v in _MEMBERS.items()},
                   **{k.upper(): f"[^{v}]" for k, v in _MEMBERS.items()}}
_DOT: Final = f"[^{_LINE_ENDS}]"


#: An atom's place (:func:`_atoms`): outside a class, a class's opening (``[`` or ``[^``), inside
#: a class, or the ``]`` that closes it.
_OUT, _OPEN, _IN, _CLOSE = range(4)


def _atoms(pattern: str) -> list[tuple[int, str, int]]:
    """``pattern`` as (offset, atom, place): an escape is one atom (``\\`` and the character after it)."""
    atoms: list[tuple[int, str, int]] = []
    i, n = 0, len(pattern)
    in_class = False
    while i < n:
        if pattern[i] == "\\" and i + 1 < n:
            atoms.append((i, pattern[i : i + 2], _IN if in_class else _OUT))
            i += 2
            continue
        ch = pattern[i]
        if in_class:
            # A ']' right after '[' or '[^' is a member, as llguidance (Rust syntax) reads it;
            # xgrammar refuses the empty class ECMA-262 would see there.
            if ch == "]" and atoms[-1][2] != _OPEN:
                atoms.append((i, ch, _CLOSE))
                in_class = False
            else:
                atoms.append((i, ch, _IN))
        elif ch == "[":
            opener = "[^" if pattern.startswith("[^", i) else "["
            atoms.append((i, opener, _OPEN))
            in_class = True
            i += len(opener)
            continue
        else:
            atoms.append((i, ch, _OUT))
        i += 1
    return atoms


def portable_regex(pattern: str) -> str:
    """``pattern`` with ``.``, ``\\d``, ``\\w``, ``\\s`` and their negations written out with ECMA-262's meaning.

    Parameters
    ----------
    pattern : str
        A ``regex`` constraint's pattern.

    Returns
    -------
    str
        The same pattern, each of those constructs replaced by an explicit
        class; idempotent (the result has none of them left).  A class that
        holds a negated shorthand becomes an alternation: ``[a\\S]`` is
        ``(?:[a]|[^...])``, and JavaScript's any-character idiom ``[\\s\\S]``
        stays any character.

    Raises
    ------
    ConstraintError
        ``grammar``: a negated shorthand (``\\D``, ``\\W``, ``\\S``) inside a
        negated class beside other members (``[^a\\S]``: no class of
        either backend says it).
    """
    atoms = _atoms(pattern)
    out: list[str] = []
    k = 0
    while k < len(atoms):
        _, atom, place = atoms[k]
        if place == _OPEN:
            close = next((j for j in range(k + 1, len(atoms)) if atoms[j][2] == _CLOSE), None)
            if close is not None:
                out.append(_portable_class(atom, atoms[k + 1 : close]))
                k = close + 1
                continue
        if place == _OUT and atom[0] == "\\" and atom[1] in _OUTSIDE:
            out.append(_OUTSIDE[atom[1]])
        elif place == _OUT and atom == ".":
            out.append(_DOT)
        else:
            out.append(atom)  # an unclosed class passes as it is: the backend refuses it
        k += 1
    return "".join(out)


def _portable_class(opener: str, members: list[tuple[int, str, int]]) -> str:
    """One class (``opener``, its member atoms, then ``]``) with its shorthands written out."""
    kept: list[str] = []
    negated: list[tuple[int, str]] = []  # (offset, letter) of each \D, \W, \S
    escape_next = False
    for offset, atom, _ in members:
        shorthand = atom[0] == "\\" and atom[1].lower() in _MEMBERS
        if shorthand:
            # A class escape is no range end in ECMA-262 ('[\\w-.]' is \\w, '-' and '.'); written
            # out as ranges or moved away, a '-' beside it would make one, so that '-' is escaped.
            if kept and kept[-1] == "-":
                kept[-1] = "\\-"
            if atom[1] in _MEMBERS:
                kept.append(_MEMBERS[atom[1]])
            else:
                negated.append((offset, atom[1]))
            escape_next = True
            continue
        kept.append("\\-" if escape_next and atom == "-" else atom)
        escape_next = False
    if not negated:
        return opener + "".join(kept) + "]"
    if opener == "[":
        branches = ([f"[{''.join(kept)}]"] if kept else []) + [_OUTSIDE[letter] for _, letter in negated]
        return "(?:" + "|".join(branches) + ")"
    if not kept and len(negated) == 1:  # [^\S] is \s
        return _OUTSIDE[negated[0][1].lower()]
    offset, letter = negated[0]
    raise ConstraintError(
        "grammar", f"regex: \\{letter} inside a negated character class beside other members (offset {offset}) "
                   f"cannot be written as one class, and the grammar backends disagree on its meaning; spell the "
                   f"class out (\\{letter} alone means {_OUTSIDE[letter]!r})")


def misplaced_anchor(pattern: str) -> int | None:
    """The offset of the first ``^`` or ``$`` that xgrammar would drop from ``pattern`` to its harm; None: none.

    xgrammar 0.2.9 matches a whole regex and drops every ``^`` and ``$``
    that is not at the pattern's start or end (it only logs a warning), so
    ``a$b`` admits ``ab`` and ``^(a($|/))*$`` admits ``aa``.  Dropping one is
    harmless only where it stands at the start (``^``) or end (``$``) of a
    top-level alternative, at most inside groups that open (or close) right
    there: ``^a$|^b$``, ``(^a|b)c``.  Any other anchor is reported (the
    caller refuses the pattern for xgrammar; llguidance reads anchors).
    """
    atoms = [(offset, atom) for offset, atom, place in _atoms(pattern) if place == _OUT or place == _OPEN]
    for k, (offset, atom) in enumerate(atoms):
        if atom == "^":
            j = k - 1
            while j >= 0 and atoms[j][1] in ("(", "?", ":"):  # group openers, "(?:" included
                j -= 1
            if j >= 0 and not (atoms[j][1] == "|" and _depth(atoms, j) == 0):
                return offset
        elif atom == "$":
            j = k + 1
            while j < len(atoms) and atoms[j][1] == ")":
                j += 1
            if j < len(atoms) and not (atoms[j][1] == "|" and _depth(atoms, j) == 0):
                return offset
    return None


def _depth(atoms: list[tuple[int, str]], upto: int) -> int:
    """Group depth at ``atoms[upto]`` (escaped and in-class parentheses are not atoms of their own)."""
    depth = 0
    for _, atom in atoms[:upto]:
        depth += (atom == "(") - (atom == ")")
    return depth
