"""`tfdp.training.callback_order.with_callback_first` on every form `Model.fit` takes."""

import keras

from tfdp.training.callback_order import with_callback_first


def _callbacks(n):
    return [keras.callbacks.Callback() for _ in range(n)]


def test_lists_tuples_nesting_and_a_bare_callback_become_one_flat_list():
    first, a, b = _callbacks(3)
    assert with_callback_first(first, None) == [first]
    assert with_callback_first(first, []) == [first]
    assert with_callback_first(first, a) == [first, a]
    assert with_callback_first(first, (a, b)) == [first, a, b]
    assert with_callback_first(first, [[a], [b]]) == [first, a, b]
    given = [a, b]
    with_callback_first(first, given)
    assert given == [a, b]


def test_a_callback_list_is_copied_with_the_callback_first_and_its_model_and_params():
    first, a = _callbacks(2)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    given = keras.callbacks.CallbackList([a], model=model, epochs=3)
    joined = with_callback_first(first, given)
    assert isinstance(joined, keras.callbacks.CallbackList) and joined is not given
    assert joined.callbacks == [first, a] and given.callbacks == [a]
    assert first.model is model and first.params == {"epochs": 3}
