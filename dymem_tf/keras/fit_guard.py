"""Undo what a callback did to the model when ``fit`` ends with an exception.

Keras 3.15's ``TensorFlowTrainer.fit`` has no ``try``/``finally``: it calls ``on_train_end`` only when training
finishes, so a step that raises (an out-of-memory error, bad data, Ctrl-C), a callback that raises (in
``on_epoch_end``, say) or a validation run that raises leave ``fit`` without any hook being called. A
:class:`FitGuard`, armed in ``on_train_begin``, runs a clean-up function when an exception passes through one of the
calls ``fit`` makes after ``on_train_begin``:

* the train function (``model.train_function``; checked again before every step, so a train function that the
  callback or another one installs during ``fit`` is guarded too),
* each hook of the ``CallbackList`` that runs the callback (``on_epoch_begin``/``_end``, ``on_train_batch_*``,
  ``on_test_*``, and ``on_train_end``: a callback that raises there before ours is reached),
* the test function of the validation run (``model.test_function``, from its first batch to ``on_test_end``).

``StopIteration`` and ``tf.errors.OutOfRangeError`` from a step or a batch hook end the epoch (Keras catches them)
and do not count. Not covered: an exception raised by ``fit``'s own lines between these calls (e.g. Ctrl-C while
Keras resets its metrics), and one raised by the ``on_train_begin`` of a callback that comes after the guarded one
in the list (that list call is already running when the guard is armed).

The guard replaces instance attributes only (the ``CallbackList``'s hooks, the model's ``train_function`` and, during
validation, ``test_function``) and takes them all back with :meth:`FitGuard.release`.
"""
from __future__ import annotations

import functools

import tensorflow as tf

from dymem_tf import compat

#: exceptions that end an epoch of steps normally: ``fit`` and ``evaluate`` catch them around their loop of steps
END_OF_DATA = (StopIteration, tf.errors.OutOfRangeError)
#: hooks called inside that loop (what they raise may be one of END_OF_DATA, which Keras then catches too)
_BATCH_HOOKS = ("on_train_batch_begin", "on_train_batch_end", "on_test_batch_begin", "on_test_batch_end")
_EPOCH_HOOKS = ("on_epoch_begin", "on_epoch_end", "on_train_end")


class FitGuard:
    """Runs ``cleanup()`` once when an exception leaves the ``fit`` that ``callback`` is part of.

    Arm it from the callback's ``on_train_begin`` (``FitGuard(callback, cleanup).arm()``), after the callback has
    set up ``model.train_function``; call :meth:`release` when training ends normally (``cleanup`` does not run
    then). ``cleanup`` must be safe to call more than once.
    """

    def __init__(self, callback, cleanup):
        self.callback = callback
        self.model = callback.model
        self.cleanup = cleanup
        self.callback_list = None
        self._replaced: list[tuple[object, str]] = []
        self._test_function = None
        self._fired = False

    def arm(self) -> "FitGuard":
        self._guard_train_function()
        self.callback_list = compat.running_callback_list(self.callback)
        if self.callback_list is not None:
            hooks = {name: END_OF_DATA for name in _BATCH_HOOKS}
            hooks.update({name: () for name in _EPOCH_HOOKS + ("on_test_begin",)})
            after = {"on_train_batch_begin": self._guard_train_function,
                     "on_test_batch_begin": self._guard_test_function}
            for name, expected in hooks.items():
                self._replace(self.callback_list, name, expected, after=after.get(name))
            self._replace(self.callback_list, "on_test_end", (), before=self._unguard_test_function)
        return self

    def release(self) -> None:
        """Take back every replaced attribute (the model's functions keep what the callback set)."""
        self._unguard_test_function()
        train_function = getattr(self.model, "train_function", None)
        if getattr(train_function, "_dymem_guard", None) is self:
            self.model.train_function = train_function.__wrapped__
        for obj, name in self._replaced:
            if getattr(obj.__dict__.get(name), "_dymem_guard", None) is self:
                del obj.__dict__[name]
        self._replaced.clear()

    @property
    def fired(self) -> bool:
        """Whether an exception ran the clean-up."""
        return self._fired

    # -- internals -----------------------------------------------------------------------------------------------
    def _fire(self) -> None:
        if self._fired:
            return
        self._fired = True
        try:
            self.release()
        finally:
            self.cleanup()

    def _guard(self, fn, expected, before=None, after=None):
        if fn is None:
            return None
        guard = self

        @functools.wraps(fn)
        def guarded(*args, **kwargs):
            try:
                if before is not None:
                    before()
                result = fn(*args, **kwargs)
                if after is not None:
                    after()
                return result
            except expected:
                raise
            except BaseException:
                guard._fire()
                raise

        guarded._dymem_guard = self  # pylint: disable=protected-access
        return guarded

    def _replace(self, obj, name: str, expected, before=None, after=None) -> None:
        original = getattr(obj, name, None)
        if original is None or name in obj.__dict__:
            return  # not a hook of this object, or already replaced by someone else: leave it alone
        setattr(obj, name, self._guard(original, expected, before, after))
        self._replaced.append((obj, name))

    def _guard_train_function(self) -> None:
        train_function = getattr(self.model, "train_function", None)
        if train_function is not None and getattr(train_function, "_dymem_guard", None) is not self:
            self.model.train_function = self._guard(train_function, END_OF_DATA)

    def _guard_test_function(self) -> None:
        test_function = getattr(self.model, "test_function", None)
        if test_function is not None and getattr(test_function, "_dymem_guard", None) is not self:
            self._test_function = test_function
            self.model.test_function = self._guard(test_function, END_OF_DATA)

    def _unguard_test_function(self) -> None:
        if self._test_function is not None:
            if getattr(getattr(self.model, "test_function", None), "_dymem_guard", None) is self:
                self.model.test_function = self._test_function
            self._test_function = None
