"""Which variables a layer-wise optimizer decays and adapts, by name pattern.

This module owns the exclusion lists that LARS and LAMB share: the default
patterns, their validation, matching them against a variable's path, and the
per-variable flags an optimizer computes once when it is built. It also owns
the one interaction with the Keras base optimizer's own weight decay (see
`LayerwiseExclusionMixin`). The update maths stays in `lars.py` and `lamb.py`.

Patterns are regular expressions searched (`re.search`) in the variable's
`path`, e.g. `"sequential/dense/kernel"`, `"encoder/layer_normalization/gamma"`,
as in TF Model Garden's LARS/LAMB, which search the variable name (TF 2
names were full paths). Keras's own `Optimizer.exclude_from_weight_decay`
searches the short `variable.name` (`"kernel"`, `"gamma"`) instead, which
cannot tell layers apart, so it is not reused for matching.
"""

from __future__ import annotations

import re
import warnings
from typing import Iterable, Sequence

from keras import ops

#: Default exclusions: every bias, and the scale/offset (`gamma`/`beta`) of
#: BatchNormalization, LayerNormalization and GroupNormalization. Add
#: `r"rms_normalization[^/]*/scale$"` to also exclude RMSNormalization's scale.
DEFAULT_EXCLUDE_PATTERNS: tuple[str, ...] = (
    r"(^|/)bias$",
    r"(^|/)(gamma|beta)$",
)


def resolve_patterns(name: str, patterns, default: Sequence[str]) -> list[str]:
    """Validates an exclusion-pattern argument and applies its default.

    Args:
        name: the argument's name, for error messages.
        patterns: `None` (use `default`), or a list/tuple of regular
            expressions (`[]` excludes nothing).
        default: the patterns `None` stands for.

    Returns:
        A new list of pattern strings.

    Raises:
        TypeError: `patterns` is a single string, or not a sequence of strings.
        ValueError: a pattern is not a valid regular expression.
    """
    if patterns is None:
        return list(default)
    if isinstance(patterns, (str, bytes)) or not isinstance(patterns, Iterable):
        raise TypeError(
            f"`{name}` must be None or a list of regular-expression strings "
            f"searched in each variable's path. Received: {name}={patterns!r}. "
            f"To exclude one pattern, pass a list: {name}=[{patterns!r}]."
        )
    patterns = list(patterns)
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(
                f"`{name}` must be a list of regular-expression strings. "
                f"Received an element {pattern!r} of type "
                f"{type(pattern).__name__} in {name}={patterns!r}."
            )
        try:
            re.compile(pattern)
        except re.error as error:
            raise ValueError(
                f"`{name}` must hold valid regular expressions. Received: "
                f"{pattern!r} in {name}={patterns!r}, which does not compile: "
                f"{error}."
            ) from None
    return patterns


def variable_path(variable) -> str:
    """The string patterns are searched in: `variable.path` for Keras variables.

    A plain `tf.Variable` has no `path`; its `name` without the `":0"` output
    suffix is used instead (`"dense/kernel:0"` -> `"dense/kernel"`).
    """
    path = getattr(variable, "path", None)
    if path is None:
        path = re.sub(r":\d+$", "", str(variable.name))
    return path


def matches_any(patterns: Sequence[str], path: str) -> bool:
    """Whether any pattern is found (`re.search`) in `path`."""
    return any(re.search(pattern, path) is not None for pattern in patterns)


class LayerwiseExclusionMixin:
    """Per-variable weight-decay and layer-adaptation flags for an optimizer.

    Mixed into a `keras.optimizers.Optimizer` subclass, before it in the bases.
    The subclass calls `_setup_exclusions(...)` right after
    `super().__init__(...)`, and reads `self._decays[index]` and
    `self._adapts[index]` (Python booleans, so graphs hold only the ops a
    variable needs) in `update_step`, with
    `index = self._get_variable_index(variable)`.

    Weight decay in these optimizers is part of the update (it enters the
    trust ratio), so the Keras base class must not also apply its decoupled
    decay `w -= lr * weight_decay * w` (AdamW-style, `keras.optimizers.Lamb`
    relies on it; keras-team/keras#19981). The base decays every variable its
    `exclude_from_weight_decay` patterns do not match, so the mixin registers
    the empty pattern, which the public method documents as matching any name
    that contains it, i.e. all of them. `tests/training/optimizers` check there is no
    double decay.
    """

    def _setup_exclusions(self, exclude_from_weight_decay, exclude_from_layer_adaptation):
        # The patterns the user wrote (not the defaults): one that matches no
        # variable is almost always a name from another framework (BERT's
        # "LayerNorm"), so `build` warns about it.
        self._given_patterns = {
            "exclude_from_weight_decay": tuple(exclude_from_weight_decay or ()),
            "exclude_from_layer_adaptation": tuple(exclude_from_layer_adaptation or ()),
        }
        self._weight_decay_exclusions = tuple(
            resolve_patterns(
                "exclude_from_weight_decay",
                exclude_from_weight_decay,
                DEFAULT_EXCLUDE_PATTERNS,
            )
        )
        # As in TF Model Garden: layer adaptation follows the weight-decay list
        # unless given its own.
        self._layer_adaptation_exclusions = tuple(
            resolve_patterns(
                "exclude_from_layer_adaptation",
                exclude_from_layer_adaptation,
                self._weight_decay_exclusions,
            )
        )
        # Tuples and ids, not lists of variables: the Keras base optimizer
        # tracks any `keras.Variable` stored in a list attribute as its own.
        self._excluded_variable_ids = frozenset()
        self._decays = ()
        self._adapts = ()
        self._disable_base_weight_decay()

    def _disable_base_weight_decay(self):
        super().exclude_from_weight_decay(var_names=[""])

    #: The trust ratio takes norms of whole variables: under sharded optimizer
    #: state (`tfdp.distribute.optimizer_sharding`) each replica gives its
    #: chunks' `norm_terms`, the sums over replicas come back in
    #: `summed_norm_terms`, and `_whole_sums_of_squares` reads them.
    updates_whole_variables = True

    def norm_terms(self, gradient, variable):
        """float32 `[2]`: the sums of squares the trust ratio of `variable` needs, over its elements.

        Summed over the chunks of a variable they give the whole variable's.
        Reads the slots but changes nothing; call before the update.
        """
        raise NotImplementedError

    def _whole_sums_of_squares(self, index, first, second):
        """`(sum(first**2), sum(second**2))` over the whole variable `index`.

        `first` and `second` are the variable's (or, sharded, this replica's
        chunk's) tensors; sharded, the sums come from `summed_norm_terms`.
        """
        summed = getattr(self, "summed_norm_terms", None)
        if summed is None:
            return ops.sum(ops.square(first)), ops.sum(ops.square(second))
        terms = summed.terms[index]  # this replica's copy, equal on every replica
        return ops.cast(terms[0], first.dtype), ops.cast(terms[1], first.dtype)

    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        """Excludes more variables from weight decay (not from adaptation).

        Keeps the signature of `keras.optimizers.Optimizer`'s method, so code
        written for `AdamW` keeps working, with two differences: `var_names`
        are regular expressions searched in `variable.path` (a plain name such
        as `"bias"` behaves as in Keras), and they add to the exclusions
        instead of replacing them. Patterns land in `get_config()`; `var_list`
        variables are matched by identity and are not serialised.

        Args:
            var_list: `keras.Variable`s to exclude from weight decay.
            var_names: regular expressions to add to the
                `exclude_from_weight_decay` patterns.

        Raises:
            ValueError: the optimizer is already built, or a pattern is not
                a valid regular expression.
            TypeError: `var_names` is a single string.
        """
        if self.built:
            raise ValueError(
                "`exclude_from_weight_decay()` can only be called before the "
                "optimizer is built (before its first `apply`/`fit` step). "
                "Pass `exclude_from_weight_decay=[...]` to the constructor or "
                "call the method earlier."
            )
        added = tuple(resolve_patterns("var_names", var_names, ()))
        self._weight_decay_exclusions = self._weight_decay_exclusions + added
        self._given_patterns = {
            **self._given_patterns,
            "exclude_from_weight_decay":
                self._given_patterns["exclude_from_weight_decay"] + added,
        }
        self._excluded_variable_ids = self._excluded_variable_ids | frozenset(
            id(variable) for variable in var_list or ()
        )

    def _compute_exclusion_flags(self, variables):
        """Computes `self._decays` and `self._adapts` for the built variables."""
        decays, adapts = [], []
        for variable in variables:
            path = variable_path(variable)
            listed = id(variable) in self._excluded_variable_ids
            decays.append(
                not listed and not matches_any(self._weight_decay_exclusions, path)
            )
            adapts.append(not matches_any(self._layer_adaptation_exclusions, path))
        self._decays = tuple(decays)
        self._adapts = tuple(adapts)
        self._warn_unmatched([variable_path(v) for v in variables])

    def _warn_unmatched(self, paths: Sequence[str]) -> None:
        """Warns (once, at build) about given patterns that match none of `paths`."""
        unmatched, reported = {}, set(DEFAULT_EXCLUDE_PATTERNS)  # defaults may match nothing
        for argument, patterns in self._given_patterns.items():
            found = [p for p in dict.fromkeys(patterns)
                     if p not in reported and not any(re.search(p, path) for path in paths)]
            reported.update(found)
            if found:
                unmatched[argument] = found
        if not unmatched or not paths:
            return
        what = "; ".join(f"{argument}: {', '.join(map(repr, found))}"
                         for argument, found in unmatched.items())
        examples = ", ".join(repr(path) for path in paths[:4])
        warnings.warn(
            f"{type(self).__name__}: exclusion pattern(s) that match no variable of the "
            f"{len(paths)} it was built for, so they exclude nothing ({what}). Patterns "
            f"are regular expressions searched in each variable's Keras 3 path, such as "
            f"{examples}; a LayerNormalization's scale and offset are "
            f"'.../layer_normalization/gamma' and '.../beta', not TF 1 / BERT names such "
            f"as 'LayerNorm'. Fix the pattern (e.g. r'layer_normalization' or "
            f"r'(^|/)(gamma|beta)$'), or drop it.",
            UserWarning, stacklevel=4,
        )

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self._compute_exclusion_flags(variables)

    def _exclusion_config(self) -> dict:
        return {
            "exclude_from_weight_decay": list(self._weight_decay_exclusions),
            "exclude_from_layer_adaptation": list(self._layer_adaptation_exclusions),
        }
