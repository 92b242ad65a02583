"""The model registry: model names to builder functions.

This module owns the mapping from a model name (`tfdp-train --model`) to the
function that builds it, and the checks `get` makes before and after calling
a builder: the name is known, the keyword arguments are ones the builder
accepts, and the model it returns is a `keras.Model` with logits of width
`num_classes`. It builds nothing itself; the built-in families live in their
own modules (`tfdp.models.mlp`, `tfdp.models.cnn`, ...) and register themselves when
`models` is imported.

A builder is a function `(*, input_shape, num_classes, **options) ->
keras.Model` that returns logits of shape `(batch, num_classes)`, computed in
float32 by the last layer (so they stay float32 under mixed precision).
"""

from __future__ import annotations

import inspect
from typing import Callable

import keras

from tfdp.models.requirements import InputRequirements

Builder = Callable[..., keras.Model]

#: Keyword arguments every builder must accept; the caller passes them.
REQUIRED_ARGUMENTS = ("input_shape", "num_classes")

_BUILDERS: dict[str, Builder] = {}
_INPUTS: dict[str, InputRequirements] = {}


def names() -> list[str]:
    """Returns the registered model names, sorted."""
    return sorted(_BUILDERS)


def _accepted_keywords(signature: inspect.Signature) -> tuple[list[str], bool]:
    """The keyword argument names of `signature`, and whether it takes `**kwargs`."""
    keywords = [
        p.name
        for p in signature.parameters.values()
        if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    var_keyword = any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()
    )
    return keywords, var_keyword


def accepts(name: str, argument: str) -> bool:
    """Whether the registered model `name`'s builder takes the keyword `argument`.

    E.g. `accepts("resnet20", "sync_bn")`: the CLI refuses `--sync_bn` and
    `--remat` for models that cannot honour them, before building anything.

    Raises:
        ValueError: `name` is not registered.
    """
    if name not in _BUILDERS:
        raise ValueError(f"Unknown model {name!r}. Known models: {', '.join(names())}. "
                         f"Received: name={name!r}")
    keywords, _ = _accepted_keywords(inspect.signature(_BUILDERS[name]))
    return argument in keywords


def input_requirements(name: str) -> InputRequirements | None:
    """What the registered model `name` needs from one example, or None if undeclared.

    Raises:
        ValueError: `name` is not registered.
    """
    if name not in _BUILDERS:
        raise ValueError(f"Unknown model {name!r}. Known models: {', '.join(names())}. "
                         f"Received: name={name!r}")
    return _INPUTS.get(name)


def _describe(fn) -> str:
    """`module.qualname` of a function, or its repr (e.g. a functools.partial)."""
    qualname = getattr(fn, "__qualname__", None)
    return f"{fn.__module__}.{qualname}" if qualname else repr(fn)


def _check_free(name: str) -> None:
    if name in _BUILDERS:
        existing = _BUILDERS[name]
        raise ValueError(
            f"A model named {name!r} is already registered (by {_describe(existing)}). "
            f"Model names must be unique: register yours under another name. Registered: "
            f"{', '.join(names())}. Received: name={name!r}"
        )


def register(name: str, builder: Builder | None = None, *,
             inputs: InputRequirements | None = None):
    """Registers a model builder under `name`, as a decorator or a call.

    Args:
        name: the model name, e.g. `"my_cnn"`: a non-empty string without
            whitespace that is not registered yet.
        builder: a function `(*, input_shape, num_classes, **options) ->
            keras.Model` returning logits of shape `(batch, num_classes)`.
            When omitted, `register(name)` returns a decorator.
        inputs: what one example must be (`models.InputRequirements`), so
            programs check a dataset against the model before building
            anything (`tfdp-train` refuses a misfit with exit 2). Defaults to
            None: not declared, only the builder's own checks apply.

    Returns:
        `builder` itself (or a decorator that registers and returns it).

    Raises:
        ValueError: `name` is not a valid name or is already registered, or
            `builder` does not accept the keyword arguments `input_shape` and
            `num_classes`.
        TypeError: `builder` is not callable, or `inputs` is not an
            `InputRequirements`.

    Example:

    ```python
    @models.register("tiny")
    def tiny(*, input_shape, num_classes, units=32):
        inputs = keras.Input(input_shape)
        x = keras.layers.Dense(units, activation="relu")(keras.layers.Flatten()(inputs))
        return keras.Model(inputs, keras.layers.Dense(num_classes, dtype="float32")(x))

    model = models.get("tiny", input_shape=(8, 8, 1), num_classes=10)
    ```
    """
    if not isinstance(name, str) or not name or any(c.isspace() for c in name):
        raise ValueError(
            "`name` must be a non-empty string without spaces, e.g. 'my_cnn'. "
            f"Received: name={name!r}"
        )
    _check_free(name)
    if inputs is not None and not isinstance(inputs, InputRequirements):
        raise TypeError(f"`inputs` of model {name!r} must be a models.InputRequirements or "
                        f"None. Received: inputs={inputs!r}")

    def add(fn: Builder) -> Builder:
        if not callable(fn):
            raise TypeError(
                f"The builder registered as {name!r} must be callable "
                f"(*, input_shape, num_classes, **options) -> keras.Model. "
                f"Received: builder={fn!r}"
            )
        keywords, var_keyword = _accepted_keywords(inspect.signature(fn))
        missing = [a for a in REQUIRED_ARGUMENTS if a not in keywords]
        if missing and not var_keyword:
            raise ValueError(
                f"The builder registered as {name!r} must accept the keyword "
                f"arguments {' and '.join(REQUIRED_ARGUMENTS)} (the caller passes the "
                f"dataset's example shape and class count); it lacks "
                f"{', '.join(missing)}. Received: builder={_describe(fn)}"
                f"{inspect.signature(fn)}"
            )
        _check_free(name)  # Again: it may have been taken since `register(name)`.
        _BUILDERS[name] = fn
        if inputs is not None:
            _INPUTS[name] = inputs
        return fn

    return add if builder is None else add(builder)


def _check_arguments(name: str, builder: Builder, kwargs: dict) -> None:
    """Raises a ValueError naming the fix if `builder(**kwargs)` would not bind."""
    signature = inspect.signature(builder)
    try:
        signature.bind(**kwargs)
        return
    except TypeError:
        pass
    keywords, var_keyword = _accepted_keywords(signature)
    unexpected = [] if var_keyword else sorted(set(kwargs) - set(keywords))
    if unexpected:
        received = ", ".join(f"{k}={kwargs[k]!r}" for k in unexpected)
        raise ValueError(
            f"Model {name!r} does not take the argument(s) {', '.join(unexpected)}. "
            f"It accepts: {', '.join(keywords)}. Remove or rename them. "
            f"Received: {received}"
        )
    missing = [
        p.name
        for p in signature.parameters.values()
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
        and p.name not in kwargs
    ]
    raise ValueError(
        f"Model {name!r} needs the keyword argument(s) {', '.join(missing)}, e.g. "
        f"models.get({name!r}, input_shape=(8, 8, 1), num_classes=10) (the example "
        f"shape without the batch axis). Received: {', '.join(sorted(kwargs)) or 'none'}"
    )


def _check_logits(name: str, model: keras.Model, num_classes) -> None:
    """Checks a functional model's single output is `(batch, num_classes)`."""
    try:
        outputs = model.outputs
    except (AttributeError, ValueError):  # Subclassed and not built: nothing to check.
        return
    if not outputs or len(outputs) != 1:
        return
    shape = tuple(outputs[0].shape)
    if len(shape) != 2 or shape[-1] != num_classes:
        raise ValueError(
            f"Model {name!r} must output logits of shape (batch, num_classes) = "
            f"(batch, {num_classes}), but its output has shape {shape}. Fix its "
            f"builder's last layer (Dense(num_classes, dtype='float32'))."
        )


def get(name: str, **kwargs) -> keras.Model:
    """Builds the registered model `name`.

    Call it inside `strategy.scope()` so the variables are mirrored, after
    `keras.utils.set_random_seed(seed)` for reproducible initial weights.

    Args:
        name: a registered name (see `names()`).
        **kwargs: the builder's keyword arguments: `input_shape` (one
            example's shape, without the batch axis, e.g. `(8, 8, 1)` or
            `(seq_len,)`) and `num_classes` (logit width) always, plus the
            model's own options (e.g. `cnn`'s `filters`, `transformer`'s
            `vocab_size`; see each builder's docstring).

    Returns:
        An uncompiled `keras.Model` mapping a batch of inputs to float32
        logits of shape `(batch, num_classes)`.

    Raises:
        ValueError: `name` is not registered (the message lists the known
            names), a keyword argument is missing or not accepted by the
            model, or an argument is invalid for the model (the message says
            which, and how to fix it).

    Example:

    >>> model = models.get("cnn", input_shape=(8, 8, 1), num_classes=10)  # doctest: +SKIP
    >>> model.output_shape                                                 # doctest: +SKIP
    (None, 10)
    """
    if not isinstance(name, str) or name not in _BUILDERS:
        raise ValueError(
            f"Unknown model {name!r}. Known models: {', '.join(names())}. "
            f"Received: name={name!r}"
        )
    builder = _BUILDERS[name]
    _check_arguments(name, builder, kwargs)
    model = builder(**kwargs)
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"The builder of model {name!r} must return a keras.Model. "
            f"Received: {type(model).__name__}"
        )
    if "num_classes" in kwargs:
        _check_logits(name, model, kwargs["num_classes"])
    return model
