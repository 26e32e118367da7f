"""Which armed block's listener the graph pass offers a graph to when several threads arm it, and what an exception
in a listener does (dymem_tf/passes/graph_pass.py: armed, _on_graph)."""
import logging
import threading

import numpy as np
import pytest
import tensorflow as tf

import dymem_tf  # noqa: F401  (loads the libraries)
from dymem_tf.passes import graph_pass

X = np.arange(32, dtype=np.float32).reshape(4, 8) / 32


def _step_function(name="step"):
    """A tf.function called ``name`` with a gradient tape (the pass offers only graphs holding gradient ops) that
    also counts its runs in ``step.runs``."""
    w = tf.Variable(np.ones((8, 8), np.float32))
    runs = tf.Variable(0)

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.matmul(tf.nn.relu(tf.matmul(x, w)), w))
        runs.assign_add(1)
        return loss, tape.gradient(loss, w)

    step.__name__ = name
    function = tf.function(step)
    function.runs = runs
    return function


def _values(step):
    return [t.numpy() for t in step(tf.constant(X))]


# ------------------------------------------------------------------------------------------------ which listener
def test_a_graph_goes_to_its_threads_innermost_block_else_to_the_only_arming_threads():
    def block(thread):
        return graph_pass.ArmedBlock(lambda call: None, thread)

    a_outer, b, a_inner = block(1), block(2), block(1)
    select = graph_pass._select_block
    assert select([a_outer, b, a_inner], 1) == (a_inner, False)
    assert select([a_outer, b, a_inner], 2) == (b, False)
    assert select([a_outer, b, a_inner], 3) == (None, True)  # several arming threads, none of them: ambiguous
    assert select([a_outer, a_inner], 3) == (a_inner, False)  # e.g. a thread of TensorFlow's own
    assert select([], 1) == (None, False)  # nobody armed


def test_the_block_armed_last_sets_the_stage_and_the_unarmed_settings_come_back_whatever_the_exit_order():
    """Blocks of two threads may exit in any order: the stage and batch hint are the last active block's, and the
    ones from before the first block once all exited (restoring each block's predecessor left a stale stage)."""
    lib = graph_pass._library()

    def settings():  # reads them by setting them back
        stage = lib.dymem_pass_set_stage(0)
        batch = lib.dymem_pass_set_batch_hint(0)
        lib.dymem_pass_set_stage(stage)
        lib.dymem_pass_set_batch_hint(batch)
        return stage, batch

    before = settings()
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen, errors = {}, []

    def first():
        try:
            with graph_pass.armed(lambda call: None, stage="before_xla", batch_size=3):
                first_in.set()
                second_in.wait(timeout=60)
            seen["after first"] = settings()
        except BaseException as err:  # noqa: BLE001
            errors.append(err)
        first_out.set()

    thread = threading.Thread(target=first)
    thread.start()
    first_in.wait(timeout=60)
    with graph_pass.armed(lambda call: None, stage="after_partitioning", batch_size=5):
        seen["both"] = settings()
        second_in.set()
        first_out.wait(timeout=60)
    thread.join(timeout=60)
    assert errors == []
    assert seen == {"both": (2, 5), "after first": (2, 5)}
    assert settings() == before


def _arm_and_call(step, seen, armed, done, errors):
    """A thread's work: arm a listener recording what it is offered into ``seen``, wait until every thread armed
    (``armed``), call ``step``, and stay armed until every thread called its step (``done``)."""
    def listener(call):
        seen.append((call.function_name, threading.get_ident()))

    try:
        with graph_pass.armed(listener):
            armed.wait(timeout=60)
            step(tf.constant(X))
            done.wait(timeout=60)
    except BaseException as err:  # noqa: BLE001  (reported by the test)
        errors.append(err)


def test_two_threads_that_arm_the_pass_each_get_their_own_steps_graph():
    """Both armed at once, each thread's step goes to its own listener (a process-wide stack gave both graphs to
    the listener armed last)."""
    steps = [_step_function("step_a"), _step_function("step_b")]
    seen, errors = ([], []), []
    armed, done = threading.Barrier(2), threading.Barrier(2)
    threads = [threading.Thread(target=_arm_and_call, args=(steps[i], seen[i], armed, done, errors))
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    for i, name in enumerate(("step_a", "step_b")):
        assert len(seen[i]) == 1, seen
        assert seen[i][0][0].startswith(f"__inference_{name}") and seen[i][0][1] == threads[i].ident


def test_a_graph_offered_on_a_thread_that_did_not_arm_goes_to_the_only_arming_thread():
    step, seen = _step_function(), []
    with graph_pass.armed(lambda call: seen.append(threading.get_ident())):
        worker = threading.Thread(target=lambda: step(tf.constant(X)))
        worker.start()
        worker.join(timeout=120)
    assert seen == [worker.ident]


def test_with_several_arming_threads_a_graph_of_another_thread_runs_unmodified_with_one_warning(monkeypatch):
    monkeypatch.delitem(graph_pass._state, "warned_ambiguous", raising=False)
    base = _values(_step_function())
    seen, errors = ([], []), []
    done, ready = threading.Event(), threading.Barrier(3)

    def arm(i):
        def listener(call):
            seen[i].append(call.function_name)
        try:
            with graph_pass.armed(listener):
                ready.wait(timeout=60)
                done.wait(timeout=60)
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=arm, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        ready.wait(timeout=60)
        with pytest.warns(RuntimeWarning, match="several threads have it armed, so it is nobody's to plan") as caught:
            out = _values(_step_function())
            again = _values(_step_function())
    finally:
        done.set()
        for t in threads:
            t.join(timeout=120)
    assert errors == [] and seen == ([], [])
    assert len([w for w in caught if "nobody's to plan" in str(w.message)]) == 1  # once
    for a, b, c in zip(out, again, base):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, c)


# --------------------------------------------------------------------------------------------- a listener raises
def test_an_exception_in_the_listener_leaves_the_step_unmodified_names_it_and_logs_its_traceback(caplog):
    base = _values(_step_function())
    raised = RuntimeError("planner bug")

    def broken(call):
        raise raised

    step = _step_function()
    with caplog.at_level(logging.ERROR, logger="dymem_tf"):
        with pytest.warns(RuntimeWarning, match=r"the graph pass failed \(RuntimeError: planner bug\)"):
            with graph_pass.armed(broken) as block:
                out = _values(step)
    assert block.errors == [raised] and block.interrupt is None
    (logged,) = [r for r in caplog.records if r.name == "dymem_tf" and "listener raised RuntimeError" in r.message]
    assert logged.exc_info[1] is raised and "in broken" in caplog.text  # the traceback, down to the listener
    assert int(step.runs.numpy()) == 1
    for a, b in zip(out, base):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_in_the_listener_fails_the_step_and_is_raised_when_the_block_exits(interrupt):
    """Ctrl-C while the pass plans: the step does not run (its instantiation fails) and the interrupt reaches the
    code around the armed block, with the step's error as its context."""
    def interrupted(call):
        raise interrupt()

    step = _step_function()
    with pytest.raises(interrupt) as raised:
        with graph_pass.armed(interrupted):
            step(tf.constant(X))
    assert isinstance(raised.value.__context__, tf.errors.CancelledError)
    assert f"interrupted ({interrupt.__name__})" in str(raised.value.__context__)
    assert int(step.runs.numpy()) == 0
    # a block whose body swallowed the step's error still raises it as it exits
    with pytest.raises(interrupt):
        with graph_pass.armed(interrupted) as block:
            with pytest.raises(tf.errors.CancelledError):
                step(tf.constant(X))
    assert isinstance(block.interrupt, interrupt) and block.errors == []
    assert int(step.runs.numpy()) == 0
    # the pass is disarmed again: the step runs untouched
    assert float(step(tf.constant(X))[0]) == float(_step_function()(tf.constant(X))[0])


def test_an_interrupt_on_a_worker_thread_is_raised_in_the_arming_thread():
    step, worker_errors = _step_function(), []

    def call():
        try:
            step(tf.constant(X))
        except tf.errors.CancelledError as err:
            worker_errors.append(err)

    def interrupted(call):
        raise KeyboardInterrupt()

    with pytest.raises(KeyboardInterrupt):
        with graph_pass.armed(interrupted):
            worker = threading.Thread(target=call)
            worker.start()
            worker.join(timeout=120)
    assert len(worker_errors) == 1 and "interrupted (KeyboardInterrupt)" in str(worker_errors[0])
    assert int(step.runs.numpy()) == 0
