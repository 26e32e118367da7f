"""Monotone budgets (issue 48, item 3): a smaller budget never gets a plan with a higher predicted peak or fewer
bytes swapped. Each plan is an independent ``make_plan`` call on one traced step (planning only: nothing trains),
as ``bench/budget_sweep.py`` plans ResNet-50, BERT and DenseNet-121; here on a small CNN and a small transformer,
mostly at profiles where the planner before the fix broke the rule (cnn on h200 and a100, the transformer on a100:
the budget at the least-memory plan's peak swapped fewer bytes than the next larger one)."""
import dataclasses

import keras
import numpy as np
import pytest

from dymem_tf.keras import dry_run
from dymem_tf.planning import pipeline, planner
from dymem_tf.planning.cost_model import as_cost_model


def _small_cnn(batch: int):
    """Three residual blocks of 3x3 convolutions with batch norm on 32x32 images (Adam)."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((32, 32, 3))
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inp)
    for width in (16, 32, 32):
        s = keras.layers.Conv2D(width, 3, padding="same")(h)
        s = keras.layers.Activation("relu")(keras.layers.BatchNormalization()(s))
        s = keras.layers.Conv2D(width, 3, padding="same")(s)
        h = keras.layers.Conv2D(width, 1)(h) if h.shape[-1] != width else h
        h = keras.layers.Activation("relu")(h + s)
    model = keras.Model(inp, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h)))
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    return model, rng.uniform(size=(batch, 32, 32, 3)).astype("float32"), rng.integers(0, 10, (batch,))


def _small_transformer(batch: int, seq: int = 32, dim: int = 64):
    """Two encoder blocks (multi-head attention, layer norms, GELU MLP) over 32 tokens (AdamW)."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((seq,), dtype="int32")
    h = keras.layers.Embedding(1000, dim)(inp)
    for _ in range(2):
        h = keras.layers.LayerNormalization()(h + keras.layers.MultiHeadAttention(4, dim // 4)(h, h))
        f = keras.layers.Dense(dim)(keras.layers.Dense(4 * dim, activation="gelu")(h))
        h = keras.layers.LayerNormalization()(h + f)
    model = keras.Model(inp, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(h)))
    model.compile(optimizer=keras.optimizers.AdamW(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    return model, rng.integers(0, 1000, (batch, seq)).astype("int32"), rng.integers(0, 10, (batch,))


MODELS = {"cnn": (_small_cnn, 16), "transformer": (_small_transformer, 32)}
_prepared: dict = {}


def prepared(name: str):
    """(prepared step, persistent bytes for the planner, batch) of a model, traced once per session and prepared
    as the callback's pass prepares a step under a budget on the CPU device (offloading, recomputation)."""
    if name not in _prepared:
        build, batch = MODELS[name]
        model, x, y = build(batch)
        traced = dry_run.trace_train_step(model, batch, x, y)
        assert traced.unsupported is None, traced.unsupported
        settings = pipeline.PlanSettings(budget_bytes=1, offload_variables=True, offload_weights=True,
                                         batch_size=batch, onednn_later=traced.onednn_later)
        prep = pipeline.prepare_step(traced.step_graph, settings, copy=True)
        _prepared[name] = (prep, max(traced.persistent_bytes - prep.modelled - prep.modelled_weights, 0), batch)
    return _prepared[name]


def plan(prep, persistent: int, batch: int, profile: str, budget=None, least_memory=False):
    return planner.make_plan(prep.graph, "dymem", budget_bytes=budget, persistent_bytes=persistent, profile=profile,
                             batch_size=batch, swapin_ahead=1, headroom=0.0, least_memory=least_memory,
                             weights=prep.weights, recomputable=prep.recomputable)


@pytest.mark.parametrize("name, profile", [("cnn", "h200"), ("cnn", "a100"), ("cnn", "cpu"),
                                           ("transformer", "a100"), ("transformer", "h200")])
def test_a_smaller_budget_never_raises_the_peak_nor_swaps_less(name, profile):
    prep, persistent, batch = prepared(name)
    least = plan(prep, persistent, batch, profile, least_memory=True)
    low, high = least.predicted.peak_bytes, least.predicted.no_swap_peak_bytes
    assert low < high
    budgets = [high - round(k * (high - low) / 5) for k in range(6)]  # from the plain peak to the least memory
    rows = []
    for budget in budgets:
        p = plan(prep, persistent, batch, profile, budget)
        assert p.predicted.peak_bytes <= budget
        assert planner.validate_plan(prep.graph, p) == []
        rows.append((budget, p.predicted.peak_bytes, p.swapped_bytes, p.predicted.step_time_s))
    assert rows[0][2] == 0  # the plain peak fits without swapping
    for prev, cur in zip(rows, rows[1:]):
        assert cur[1] <= prev[1], f"budget {cur[0]}: peak {cur[1]} above {prev[1]} at budget {prev[0]}\n{rows}"
        assert cur[2] >= prev[2], f"budget {cur[0]}: {cur[2]} bytes swapped, {prev[2]} at budget {prev[0]}\n{rows}"


def test_the_greedy_search_walks_one_chain_whatever_the_budget():
    """The greedy rounds do not read the budget: a smaller budget's swap set contains a larger one's (sizing each
    round's batch by the excess over the budget made each budget walk its own chain: 1 of these 11 pairs was not
    nested on this transformer)."""
    prep, persistent, _ = prepared("transformer")
    pl = planner._Planner(prep.graph, as_cost_model("h200"), planner.DEFAULT_MIN_SWAP_BYTES, 1, 3, None,
                          prep.weights, prep.recomputable)
    pool = pl.candidates("dymem", relaxed=True)
    plain = pl.run([], persistent).peak_bytes
    full = pl.run(pl.decisions("dymem", pool, "queue"), persistent).peak_bytes
    prev = None
    for k in range(12):
        budget = plain - round(k * (plain - full) / 11)
        chosen, res = pl.fit_budget("dymem", "queue", pool, [], budget, persistent)
        swapped = {c.tensor for c in chosen}
        if prev is not None:
            assert prev[1] <= swapped, f"budget {budget}: {sorted(prev[1] - swapped)} dropped (at {prev[0]})"
        prev = (budget, swapped)


def test_a_memo_reuses_the_planner_across_headrooms_and_changes_no_plan():
    """A placed plan's headroom search plans one step at several headrooms with one :class:`planner.PlannerMemo`:
    the planner (its candidates and hideable sets) is made once, and every plan equals the one made without it."""
    prep, persistent, batch = prepared("cnn")
    least = plan(prep, persistent, batch, "h200", least_memory=True)
    budget = (least.predicted.peak_bytes + least.predicted.no_swap_peak_bytes) // 2
    memo, made = planner.PlannerMemo(), []
    for headroom in (0.0, 0.05, 0.1, 0.02):
        kwargs = dict(budget_bytes=budget, persistent_bytes=persistent, profile="h200", batch_size=batch,
                      swapin_ahead=1, headroom=headroom, weights=prep.weights, recomputable=prep.recomputable)
        alone = planner.make_plan(prep.graph, "dymem", **kwargs)
        reused = planner.make_plan(prep.graph, "dymem", memo=memo, **kwargs)
        made.append(memo._planner)  # noqa: SLF001
        assert [(s.tensor, s.kind, [si.trigger_op for si in s.swap_ins]) for s in reused.swaps] == \
            [(s.tensor, s.kind, [si.trigger_op for si in s.swap_ins]) for s in alone.swaps]
        assert reused.predicted.peak_bytes == alone.predicted.peak_bytes
    assert all(p is made[0] for p in made)
    other = planner.make_plan(prep.graph, "dymem", budget_bytes=budget, persistent_bytes=persistent, profile="a100",
                              batch_size=batch, swapin_ahead=1, weights=prep.weights,
                              recomputable=prep.recomputable, memo=memo)
    assert memo._planner is not made[0] and other.predicted.peak_bytes <= budget  # noqa: SLF001


def test_a_plan_ordered_after_the_search_is_the_plan_ordered_at_once():
    """The headroom search orders only the plan it keeps: ``with_sequence`` of an unordered plan gives the same
    chain, bands and notes as ``finish_plan`` ordering it at once."""
    prep, persistent, batch = prepared("cnn")
    least = plan(prep, persistent, batch, "cpu", least_memory=True)
    budget = (least.predicted.peak_bytes + least.predicted.no_swap_peak_bytes) // 2
    settings = pipeline.PlanSettings(budget_bytes=budget, persistent_bytes=persistent, offload_variables=True,
                                     offload_weights=True, batch_size=batch)
    at_once = pipeline.finish_plan(prep, settings)
    unordered = pipeline.finish_plan(prep, settings, planner.PlannerMemo(), sequenced=False)
    assert not unordered.sequence.ops
    later = pipeline.with_sequence(unordered, settings)
    assert at_once.sequence.ops and later.sequence == at_once.sequence
    assert later.plan.notes == at_once.plan.notes


def test_after_a_step_that_ran_out_of_memory_only_a_plan_placed_within_the_limit_is_tried():
    """Each guarded try of a budgeted plan that runs out of memory skips a batch (ResNet-50 + Adam, batch 258 under
    512 MiB: a refinement placed 0.3 MiB over its limit ran out too, and the probe's plan trained after two skipped
    batches). After such a step the headroom search keeps no plan placed over the limit: no plan fits, and the
    session keeps the plan known to fit; after a step that ran, the lowest is kept and guarded as before."""
    from dymem_tf.memory import placement
    from dymem_tf.passes import step_pass
    from dymem_tf.planning import first_step

    prep, persistent, batch = prepared("cnn")
    least = plan(prep, persistent, batch, "cpu", least_memory=True)
    budget = int(least.predicted.no_swap_peak_bytes)
    group = placement.PersistentGroup(reserved_bytes=2 << 20, in_use_bytes=1 << 20)
    settings = pipeline.PlanSettings(budget_bytes=budget, persistent_bytes=persistent, offload_variables=True,
                                     offload_weights=True, batch_size=batch, profile="cpu")
    pass_ = step_pass.StepPass(settings, verbose=0)
    for outcome in ("ran", "out_of_memory"):
        # a residual of the whole budget: every plan is placed over the limit
        cal = first_step.Calibration(budget, least.predicted.peak_bytes, budget, persistent, headroom=0.05,
                                     measured_in_use_bytes=least.predicted.peak_bytes, margin=0.05,
                                     source="calibrated", persistent_group=dataclasses.asdict(group),
                                     placement_residual_bytes=budget, outcome=outcome)
        req = step_pass.PlanRequest(budget_bytes=budget, calibration=cal, headroom=cal.headroom)
        if outcome == "ran":
            kept = pass_._placed_plan(prep, settings, req)  # noqa: SLF001
            assert kept.plan.predicted.calibrated_peak_bytes > (1 - cal.margin) * budget  # over, guarded
        else:
            with pytest.raises(planner.BudgetTooSmallError, match="ran out of memory"):
                pass_._placed_plan(prep, settings, req)  # noqa: SLF001


def _sweep(name: str, profile: str):
    """(prepared step, persistent bytes, its planner at ``profile``, the hideable candidates, 9 budgets evenly
    between the plain peak and the peak with every hideable candidate swapped)."""
    prep, persistent, _ = prepared(name)
    pl = planner._Planner(prep.graph, as_cost_model(profile), planner.DEFAULT_MIN_SWAP_BYTES, 1, 3, None,
                          prep.weights, prep.recomputable)
    hidden = pl.hideable(pl.candidates("dymem"))
    plain = pl.run([], persistent).peak_bytes
    full = pl.run(pl.decisions("dymem", hidden, "queue"), persistent).peak_bytes
    return prep, persistent, pl, hidden, [plain - round(k * (plain - full) / 10) for k in range(1, 10)]


@pytest.mark.parametrize("name, profile", [("cnn", "h200"), ("transformer", "a100")])
def test_downsizing_moves_fewer_bytes_and_keeps_the_budget_and_the_speed(name, profile):
    """The greedy chain adds the largest tensors at the peak; its last may hold far more than the budget needs.
    Downsizing replaces such swaps by smaller ones (or drops them): at every budget of a sweep the plan fits, is no
    slower, and never moves more bytes than the greedy set, and on some budgets it moves fewer."""
    prep, persistent, pl, hidden, budgets = _sweep(name, profile)
    pool = pl.candidates("dymem", relaxed=True)
    fewer = 0
    for budget in budgets:
        chosen, res = pl.fit_budget("dymem", "queue", hidden, [], budget, persistent)
        assert res.peak_bytes <= budget
        kept, r = pl.downsize("dymem", "queue", pool, chosen, budget, persistent, res)
        assert r.peak_bytes <= budget and r.step_time_s <= res.step_time_s * (1 + 1e-9)
        assert r.peak_bytes == pl.run(pl.decisions("dymem", kept, "queue"), persistent).peak_bytes
        assert pl.moved_bytes(kept) <= pl.moved_bytes(chosen)
        fewer += pl.moved_bytes(kept) < pl.moved_bytes(chosen)
    assert fewer >= 3
    notes = [n for budget in budgets for n in plan(prep, persistent, MODELS[name][1], profile, budget).notes]
    assert any(n.startswith("downsized: ") for n in notes)  # make_plan downsizes too, and says so


@pytest.mark.parametrize("name, profile", [("cnn", "h200"), ("transformer", "a100")])
def test_partial_swaps_fill_the_room_whole_tensors_leave_and_the_plan_still_fits(name, profile):
    """Between whole tensors a budgeted plan leaves room (issue 48); the fill keeps rows of its swapped feature
    maps on the device: at every budget of a sweep the filled plan fits, is no slower, its simulation is its own,
    it moves no more bytes, and on some budgets it keeps rows and comes closer to the budget. Every kept part is
    some, not all, of a feature map's rows, in proportion."""
    prep, persistent, pl, hidden, budgets = _sweep(name, profile)
    filled = 0
    for budget in budgets:
        chosen, res = pl.fit_budget("dymem", "queue", hidden, [], budget, persistent)
        swaps = pl.decisions("dymem", chosen, "queue")
        res = pl.run(swaps, persistent)
        out, r = pl.fill(swaps, budget, persistent, res)
        assert r.peak_bytes <= budget and r.step_time_s <= res.step_time_s * (1 + 1e-9)
        assert r.peak_bytes == pl.run(out, persistent).peak_bytes
        assert sum(s.moved_bytes for s in out) <= sum(s.moved_bytes for s in swaps)
        for s in out:
            if s.kept_bytes:
                rows = prep.graph.tensors[s.tensor].shape[0]
                assert s.kind == "tensor" and 0 < s.keep_rows < rows and s.kept_bytes * rows == s.keep_rows * s.bytes
        if any(s.kept_bytes for s in out):
            filled += 1
            assert r.peak_bytes > res.peak_bytes  # the kept rows use the room
    assert filled >= 3
    notes = [n for budget in budgets for n in plan(prep, persistent, MODELS[name][1], profile, budget).notes]
    assert any(n.startswith("partial swaps: ") for n in notes)  # make_plan fills too, and says so
