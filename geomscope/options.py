"""Options as data: a command's options are declared once, as the fields of a frozen dataclass.

Each field carries its default (the dataclass default) and, in its metadata, an :class:`Option`:
the flag, the help, the metavar and a constraint. The constraint types are data in the manner of
scikit-learn's ``_param_validation``: each says whether a value satisfies it (:meth:`reason` is
None, or the words that say what the value must be) and which values do not
(:meth:`invalid`, what the generated tests feed every option). One checker, :func:`check`,
walks a declaration; the CLI builds each ``typer.Option`` from the same field
(:func:`geomscope.cli._options.declared_option`) and leaves the checking to the library, so a
value given on the command line and one given to the library function meet the same rule and
the same one-line error.
"""

from __future__ import annotations

import dataclasses
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from numbers import Integral, Real

from geomscope.choices import MAX_SEED, MAX_SEED_TEXT, SEED_BITS
from geomscope.errors import InputError


class OptionError(InputError):
    """A value outside its option's declared constraint (the CLI points to ``--help``)."""


class Constraint(ABC):
    """What the values of an option must be."""

    @abstractmethod
    def reason(self, value) -> str | None:
        """None when ``value`` satisfies the constraint, else 'must be …' words."""

    @abstractmethod
    def invalid(self) -> tuple:
        """Values that break the constraint (each must make :meth:`reason` say why)."""

    def given(self, value) -> str:
        """``value`` as the error line quotes it: its repr."""
        return repr(value)

    def culprit(self, value) -> str | None:
        """The part of a refused ``value`` to name beside it (a list's bad word), or None."""
        return None


def _is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class Interval(Constraint):
    """A whole number (``whole=True``) or a finite real number in [low, high]; an open end is
    excluded. ``words`` replaces the generated description where a name reads better."""

    whole: bool
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    words: str | None = None

    def describe(self) -> str:
        if self.words:
            return self.words
        kind = "a whole number" if self.whole else "a number"
        lo = None if self.low is None else f"{'>' if self.open_low else '>='} {self.low:g}"
        hi = None if self.high is None else f"{'<' if self.open_high else '<='} {self.high:g}"
        return " ".join([kind, " and ".join(b for b in (lo, hi) if b)]).strip()

    def reason(self, value) -> str | None:
        ok = _is_int(value) if self.whole else _is_real(value) and math.isfinite(value)
        if ok and self.low is not None:
            ok = value > self.low if self.open_low else value >= self.low
        if ok and self.high is not None:
            ok = value < self.high if self.open_high else value <= self.high
        return None if ok else f"must be {self.describe()}"

    def invalid(self) -> tuple:
        bad: list = ["1", None if self.whole else math.nan, True]
        if self.whole:
            bad.append(1.5)
        if self.low is not None:
            bad.append(self.low if self.open_low else self.low - 1)
        if self.high is not None:
            bad.append(self.high if self.open_high else self.high + 1)
        return tuple(v for v in bad if v is not None)


#: whole numbers from 1 up: sizes, counts, limits
POSITIVE_INT = Interval(whole=True, low=1, words="a positive whole number")
#: a probability strictly between 0 and 1
PROBABILITY = Interval(whole=False, low=0, high=1, open_low=True, open_high=True, words="between 0 and 1")
#: how --help states SEED's range (its 20-digit bound in full would read as noise)
SEED_RANGE = f"0 <= N < 2^{SEED_BITS}"
#: one rule for every seed: numpy's and the sample's 64-bit seeds
SEED = Interval(whole=True, low=0, high=MAX_SEED, words=f"a whole number from 0 to {MAX_SEED_TEXT}")


def choice_metavar(values: tuple[str, ...]) -> str:
    """How --help shows a closed set: ``[a|b|c]``."""
    return "[" + "|".join(values) + "]"


@dataclass(frozen=True)
class Choice(Constraint):
    """One of a closed set of strings (from :mod:`geomscope.choices`)."""

    values: tuple[str, ...]

    def reason(self, value) -> str | None:
        return None if value in self.values else f"must be one of {', '.join(self.values)}"

    def invalid(self) -> tuple:
        return ("no-such-choice", "", 3)


@dataclass(frozen=True)
class Parsed(Constraint):
    """A string that ``parse`` reads (raising InputError with its own words otherwise): the
    options with a small grammar of their own (``--keep``, ``--capture``, ``--max-memory``)."""

    parse: Callable
    bad: tuple = ()

    def reason(self, value) -> str | None:
        if not isinstance(value, str):
            return "must be text"
        try:
            self.parse(value)
        except InputError as e:
            return str(e)  # the parser's own words name the option and the value
        return None

    def invalid(self) -> tuple:
        return (*self.bad, 5)


@dataclass(frozen=True)
class Text(Constraint):
    """Any non-empty string (a field or column name, a path, a revision)."""

    def reason(self, value) -> str | None:
        return None if isinstance(value, str) and value.strip() else "must be a non-empty name"

    def invalid(self) -> tuple:
        return ("", "  ", 7)


_DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$", re.IGNORECASE)


@dataclass(frozen=True)
class Device(Constraint):
    """The spelling of a torch device: auto, cpu, cuda, cuda:N or mps (whether it is present is
    asked when the model is placed: :func:`geomscope.devices.resolve_device`)."""

    def reason(self, value) -> str | None:
        ok = isinstance(value, str) and _DEVICE.match(value.strip())
        return None if ok else "must be auto, cpu, cuda, cuda:N or mps"

    def invalid(self) -> tuple:
        return ("gpu", "cuda:x", "", 0)


@dataclass(frozen=True)
class Layers(Constraint):
    """A ``--layers`` selection as written (:mod:`geomscope.layers` reads it against the layers a
    model, a run or a report has): a non-empty comma list, or a list of names and indices. Its own
    rule, not :func:`comma_items`': an empty item (``1,,2``, ``-l ""``) is refused rather than
    skipped, since a lost layer name would silently select other layers."""

    def reason(self, value) -> str | None:
        if isinstance(value, str):
            items = value.split(",")
        elif isinstance(value, (list, tuple)):
            items = [str(v) if _is_int(v) else v for v in value]
        else:
            return "must be a comma list of layers"
        if not items or any(not isinstance(v, str) or not v.strip() for v in items):
            return "must be a comma list of layers with no empty item"
        return None

    def invalid(self) -> tuple:
        return ("", "1,,2", " ", 2.5)


@dataclass(frozen=True)
class Flag(Constraint):
    """True or False."""

    def reason(self, value) -> str | None:
        return None if isinstance(value, bool) else "must be true or false"

    def invalid(self) -> tuple:
        return ("yes", 1)


def comma_items(value) -> list:
    """The items of a list option: ``value`` one comma list (``"8,32"``), or a list or tuple whose
    strings may each be a comma list (a repeated option gives them); each comma list's words are
    stripped and the empty ones skipped, other items kept as given; None has none. The one reading
    of a comma list: the declared lists' (:meth:`CommaList.items`), a layer selection's
    (:func:`geomscope.layers.layer_items`) and the CLI's own lists'. A str is never iterated (its
    characters would read as items: ``metrics="isoscore"`` as the metric 'i')."""
    if value is None:
        return []
    out: list = []
    for part in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(part, str):
            out.extend(w.strip() for w in part.split(",") if w.strip())
        else:
            out.append(part)
    return out


@dataclass(frozen=True)
class CommaList(Constraint):
    """A list option: one comma list (``8,32``), or a list or tuple whose strings may each be a
    comma list (a repeated option gives them); empty words are skipped. Each word is read by
    ``convert`` (a word it cannot read stays text, for ``item`` to refuse); every value must satisfy
    ``item``. ``what`` names the values in the error. With ``nonempty`` an empty list is refused;
    without, whether it means everything or nothing is the command's to say, as is which names
    exist."""

    what: str
    item: Constraint = Text()
    convert: Callable = str
    nonempty: bool = False

    def items(self, value) -> list:
        """The values of ``value`` (:func:`comma_items`), each comma list's words read by ``convert``."""
        return [self._read(v) if isinstance(v, str) else v for v in comma_items(value)]

    def _read(self, word: str):
        try:
            return self.convert(word)
        except ValueError:
            return word

    def describe(self) -> str:
        return f"a comma list of {self.what}"

    def given(self, value) -> str:
        """A list of words quoted as the one comma list it reads as (``'isoscore,nope'``)."""
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return repr(",".join(value))
        return repr(value)

    def culprit(self, value) -> str | None:
        """In a list of several words, the first the item constraint refuses: ``'nope' is not one``."""
        if not isinstance(value, (str, list, tuple)):
            return None
        words = self.items(value)
        bad = [v for v in words if self.item.reason(v) is not None]
        return f"{bad[0]!r} is not one" if bad and len(words) > 1 else None

    def reason(self, value) -> str | None:
        values = self.items(value) if isinstance(value, (str, list, tuple)) else None
        ok = values is not None and (bool(values) or not self.nonempty)
        ok = ok and all(self.item.reason(v) is None for v in values)
        return None if ok else f"must be {self.describe()}"

    def invalid(self) -> tuple:
        """Not a list; a list holding None; each of the item's invalid values as a word (a string)
        or as a list's item; and, with ``nonempty``, the empty lists. A word ``convert`` reads into
        a valid value (the string "1" of whole numbers) is left out."""
        bad = [7, 2.5, (None,), *(("", ",", ()) if self.nonempty else ())]
        bad += [v if isinstance(v, str) else (v,) for v in self.item.invalid()]
        return tuple({repr(v): v for v in bad if self.reason(v) is not None}.values())


#: a number in [0, 1]: a shrinkage weight, a fraction
UNIT_INTERVAL = Interval(whole=False, low=0, high=1, words="a number in [0, 1]")


@dataclass(frozen=True)
class Option:
    """One declared option: its constraint, help and command-line form. ``optional``: None is a
    value (the option is unset); ``flag``: the long flag (default ``--field-name``); ``off``: the
    flag that sets a :class:`Flag` False where its default, None, leaves the choice to the command
    (``--log-x/--linear-x``); ``negated``: ``flag`` alone sets a :class:`Flag` that is True by
    default to False (``--no-verify``)."""

    constraint: Constraint
    help: str
    metavar: str | None = None
    flag: str | None = None
    short: str | None = None
    off: str | None = None
    optional: bool = False
    hidden: bool = False
    negated: bool = False


def verify_option() -> dataclasses.Field:
    """``verify`` of every command that reads a run's shards: their checksums are checked unless
    ``--no-verify`` is given (their sizes are checked either way)."""
    return option(
        True,
        Flag(),
        "Skip the shard checksum check (size is still checked).",
        flag="--no-verify",
        negated=True,
    )


#: the default of an option that has none: it must be given (``export --to``)
REQUIRED = dataclasses.MISSING


def option(default, constraint: Constraint, help: str, **form) -> dataclasses.Field:
    """A dataclass field declaring an option (``form``: the keywords of :class:`Option`); a
    ``REQUIRED`` option is a field without a default."""
    return field(default=default, metadata={"option": Option(constraint, help, **form)})


def declared(cls) -> dict[str, Option]:
    """Field name -> its :class:`Option` (with the flag filled in), in declaration order."""
    out = {}
    for f in dataclasses.fields(cls):
        opt = f.metadata.get("option")
        if opt is not None:
            flag = opt.flag or "--" + f.name.replace("_", "-")
            out[f.name] = dataclasses.replace(opt, flag=flag)
    return out


def default_of(cls, name: str):
    """The declared default of field ``name`` of ``cls`` (``REQUIRED`` where it has none)."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def check(options) -> None:
    """Check every declared option of ``options`` (a declared dataclass instance); OptionError
    naming the flag, what its value must be and the value given, at the first that fails."""
    for name in declared(type(options)):
        check_value(type(options), name, getattr(options, name))


def check_value(cls, name: str, value) -> None:
    """Check ``value`` against the declared option ``name`` of ``cls`` (one item of a grid's comma
    list, too); OptionError worded as :func:`check` words it."""
    opt = declared(cls)[name]
    if value is None and opt.optional:
        return
    why = opt.constraint.reason(value)
    if why is not None and isinstance(opt.constraint, Parsed) and isinstance(value, str):
        raise OptionError(why)
    if why is not None:
        culprit = opt.constraint.culprit(value)
        note = f" ({culprit})" if culprit else ""
        raise OptionError(f"{opt.flag} {why}, not {opt.constraint.given(value)}{note}")


def invalid_settings(cls) -> Iterator[tuple[str, str, object]]:
    """(field, flag, value) for every invalid value of every declared option of ``cls``: what the
    generated tests feed each option."""
    for name, opt in declared(cls).items():
        for value in opt.constraint.invalid():
            yield name, opt.flag, value
