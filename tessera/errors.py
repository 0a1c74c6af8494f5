"""Error types raised by tessera.

Every error a user can hit is a ``TesseraError``; the subclasses say which stage refused.
"""

from __future__ import annotations


class TesseraError(Exception):
    """Base class of every error tessera raises on purpose."""


class ConfigError(TesseraError, ValueError):
    """A ``CompileConfig`` field (or ``TESSERA_*`` variable) has a value tessera cannot use."""


class CallArgumentsError(TesseraError, TypeError):
    """A call's arguments do not fit the model's signature: a ``TypeError``, as eager raises."""


class UnsupportedModelError(TesseraError):
    """The model cannot be traced as one graph (graph break, data-dependent branch, ...).

    ``dynamo_error`` holds Dynamo's own exception when there was one.
    """

    dynamo_error: BaseException | None = None


class UnsupportedArgumentError(UnsupportedModelError):
    """An argument tessera cannot take (eager would): the trace failed where the forward uses it
    (a generator, a lock, an open file). ``argument`` names it; the message says what to pass."""

    argument: str = ""


class SizeFixedError(UnsupportedModelError):
    """A dim traced as dynamic has a size the model's code fixes (Dynamo's constraint violation):
    one graph cannot serve every size. ``tessera.compile`` then traces once per size, as
    ``torch.compile`` recompiles, and raises this only where that is not possible."""


class SizeNotCompiledError(TesseraError):
    """A call arrived with a dynamic size that no compiled artifact covers."""


class CompilerError(TesseraError):
    """A compiler adaptor failed, or a custom ``module:Class`` compiler could not be loaded."""


class ArtifactDamaged(CompilerError):
    """Raised by a compiler's ``load`` when the bytes it was handed are not an artifact it can read
    (a parse or unpickle error). tessera reports the file as cache damage and recompiles the piece;
    anything else ``load`` raises is a failure of the loader, raised as a ``CompilerError``."""


class CacheError(TesseraError):
    """The persistent cache could not be used (a problem tessera cannot heal by recompiling)."""


class TesseraWarning(UserWarning):
    """Something tessera stepped around (a cache it could not use, a splitting op that matched
    nothing): results stay correct, but the user should know."""


class CacheWarning(TesseraWarning):
    """A cache root or entry could not be used (unwritable, full, not trusted); the model runs
    without that part of the cache."""


class FallbackWarning(TesseraWarning):
    """tessera took a slower path (a trace instead of the whole-model artifact) because of an
    unexpected error, not damage or a changed model: results stay correct, but the error is most
    likely a bug worth reporting. Warned once per error per process; every fallback is counted."""


class TraceLimitWarning(TesseraWarning):
    """A model met more kinds of call than it may hold traces for (``max_traces`` not given): the
    calls no trace covers are served eagerly from then on, right but slower. Warned once per model,
    naming what changed; usually a Python value the forward changes on each call (a counter)."""


class UntestedTorchWarning(TesseraWarning):
    """The installed torch is outside the range tessera is tested on (warned once per process)."""


def first_line(error: BaseException) -> str:
    """An exception's first line (torch's carry a page of context), for a log line."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
