"""Make the executor run the step's ops in the order the simulator planned them.

The simulator runs the compute ops in dependency-layer order (:meth:`StepGraph.execution_order`); TF's executor
runs an op as soon as its inputs exist, on whichever inter-op thread is free, so two steps of the same graph may
interleave parallel branches differently, and with one inter-op thread it runs depth-first. The peak of a step
depends on that order: without the chain the plan's steps differed by up to 27% (docs/reliability.md), and with
``TF_NUM_INTEROP_THREADS=1`` a plan that fitted in the simulator ran out of memory.

This stage chains the step's ops with control edges in the simulated order, so every step runs them in that
order and, under a budget, the prediction holds for every step, whatever the thread count (without one, see
"Bands" below). The values are unchanged (control edges only delay an op), so results stay bit-identical;
intra-op parallelism is untouched, only the overlap of independent ops is given up, where bands do not give it
back (on a GPU the kernels go to one compute stream in order anyway; the swap ops are not
chained and still overlap compute on their own threads).

With oneDNN's CPU kernels on (TF's default on some x86 CPUs), its layout pass rewrites the graph after
partitioning and fuses ops only where no other edge leaves them; the pass therefore plans the partition oneDNN
left (:func:`dymem_tf.passes.graph_pass.default_stage`), and the chain cannot change what it fuses. Where the pass
acts before that rewrite (several replicas, or ``xla="auto"``: ``onednn_later``), a CPU step is not chained.

A step that runs inside a loop (Keras' ``steps_per_execution > 1`` puts the whole step in one) is not chained
either: edges inside a loop body order one iteration only, and TF's executor then fed an ``OptionalHasValue`` the
wrong input.

Grappler's memory optimizer (its scheduling pass, on when its static estimate of the step exceeds 80% of the
device's memory: 205 MiB of a CPU device's nominal 256 MiB) rewrites a gradient's ``AddN`` of more than two inputs
into a temporary variable that one ``AssignAdd`` per input accumulates into, each as soon as its input is ready. The
sum then depends on the order the executor runs them in (float addition is not associative), so those ops stay out
of the chain and run as TF would run them: chained in the simulator's order, InceptionV3's (75 px, batch 16) weights
differed from a plain run's after one step, every time. Left to TF, the order is still its threads' race: two
plain runs of that step usually agree and sometimes do not, with or without Dymem, so the plan says so
(:func:`accumulation_note`).

Left out of the chain, as Grappler's memory optimizer leaves what it cannot handle: ops in lowered conditional
branches (a dead op would never release its successor), control-flow ops, ops in another loop frame than the
step's (TF forbids edges across frames), ops on another device than the step's (an edge across devices costs a
send and a receive), and ops without inputs (constants, arguments: ready at the start whatever is done).

Bands. A strict chain also serialises ops that could run side by side without changing the peak: far from the
step's peak the order of a few ops moves the bytes in use by less than the distance to the peak. :func:`find_bands`
cuts the chain into *bands* of consecutive ops; the rewrite orders the bands (every op of a band waits for every op
of the band before it) and leaves the order inside a band to TF's executor. Whatever that order, the bytes in use
inside a band stay below the bytes in use when it starts plus every allocation its ops make, and a band is only as
long as that bound stays within the simulated peak. Near the peak the bands are single ops: the strict chain, so
the step's peak is still the simulated one, contractions aside.

A contraction (:data:`CONTRACTION_MARKERS`) holds a workspace no graph shows: TF's CPU convolution gradients fill a
30 MiB im2col working set whatever the batch (``target_working_set_size`` in TF's conv_grad_input_ops.h), Eigen
packs a convolution's or a matrix product's operands in blocks of its own. In a band it sits on top of whatever
the band's other ops allocated first, and two contractions of a band may hold theirs at once. Under a budget (the
probe, and every plan after it) each contraction is therefore a band of its own and starts on the bytes the strict
chain would hold; bands that held convolutions took the gated CNN's probe and calibrated plan well past their
prediction.

Without a budget the plan has no bound to keep, only a peak to repeat, and contractions share bands like any op:
on two cores what TF's executor gains by running ops side by side is mostly two contractions at once, and with
each alone the planned order cost DenseNet-121 up to 17% of TF's step time. Sharing, the bytes in use repeat from
step to step but for the contractions' workspaces, which coexist whenever the executor's threads happen to run two
contractions at once: the peak depends on the inter-op thread count, may reach TF's own, and may be lower in a step
where the race went the other way (the two-branch convnet of tests/test_sequencing.py: 54.7 MB in most steps, 28.0 in
one of five). The measurements are in docs/reliability.md ("The executor's order", "What the order costs on the
CPU").
"""
from __future__ import annotations

import collections
import dataclasses

import numpy as np

from dymem_tf.planning.analysis import StepGraph
from dymem_tf.planning.simulator import RETURN_OP_TYPES, SimResult

#: ``execution_order`` values: "planned" chains the ops in the simulated order, in bands (:func:`find_bands`);
#: "strict" chains every op (the bytes in use repeat to the byte, the executor's threads run one op at a time);
#: "free" leaves the order to TF.
EXECUTION_ORDERS = ("planned", "strict", "free")
#: Why a CPU step with oneDNN's kernels on keeps TF's order.
ONEDNN_SKIP = ("ops left in TF's order: oneDNN's layout pass runs after Dymem's and would fuse differently around "
               "the chain's edges (TF_ENABLE_ONEDNN_OPTS=0 lets Dymem chain them)")
#: Why a step that runs inside a loop keeps TF's order.
LOOP_SKIP = ("ops left in TF's order: the step runs inside a loop (steps_per_execution > 1), whose iterations the "
             "chain's edges cannot order")
#: Control-flow ops: their inputs may be dead, or their frame differ from their inputs'.
CONTROL_FLOW_OP_TYPES = frozenset({
    "Switch", "RefSwitch", "_SwitchN", "Merge", "RefMerge", "Enter", "RefEnter", "Exit", "RefExit",
    "NextIteration", "RefNextIteration", "LoopCond", "ControlTrigger"})
#: Grappler's lowering of an ``AddN`` into a temporary variable accumulated in place (memory_optimizer's
#: SchedulingPass), and any other reference-variable update: the result depends on the order TF runs them in.
ACCUMULATION_OP_TYPES = frozenset({"TemporaryVariable", "DestroyTemporaryVariable", "Assign", "AssignAdd",
                                   "AssignSub"})
#: A function's arguments and results: TF accepts no control edge out of a result.
FUNCTION_BOUNDARY_OP_TYPES = frozenset({"_Arg", "_DeviceArg"}) | RETURN_OP_TYPES

#: Op types whose kernels hold workspaces of their own (convolutions, matrix products, einsums; oneDNN's too):
#: under a budget, each is a band of its own.
CONTRACTION_MARKERS = ("Conv", "MatMul", "Einsum")

_UNCHAINED_OP_TYPES = CONTROL_FLOW_OP_TYPES | FUNCTION_BOUNDARY_OP_TYPES | ACCUMULATION_OP_TYPES


def _step_frame_and_device(sg: StepGraph) -> tuple[str, str]:
    """The loop frame and the device most of the step's ops run in."""
    frames = collections.Counter(op.frame for op in sg.ops.values())
    devices = collections.Counter(op.device for op in sg.ops.values())
    return frames.most_common(1)[0][0], devices.most_common(1)[0][0]


def _chainable(sg: StepGraph, name: str, frame: str, device: str) -> bool:
    """Whether ``name`` may take and give an ordering edge: not conditional, not control flow, not a function's
    argument or result, not an in-place accumulation, in the step's frame and on its device, and with inputs."""
    op = sg.ops[name]
    return (not op.conditional and op.type not in _UNCHAINED_OP_TYPES
            and op.frame == frame and op.device == device and bool(op.inputs or op.control_inputs))


@dataclasses.dataclass(frozen=True)
class Sequence:
    """The order the rewrite makes the executor follow: ``ops`` in the simulator's order and, with ``with_added``,
    the swap ops the plan adds on their device, each as soon as it is ready."""

    ops: tuple[str, ...] = ()
    with_added: bool = False
    #: why nothing is chained, when that is the reason (else "")
    skipped: str = ""
    #: the band of each op (non-decreasing, from 0; :func:`find_bands`); empty: each op its own band
    bands: tuple[int, ...] = ()

    def band_count(self) -> int:
        """How many bands the ops form (each op its own without :attr:`bands`)."""
        return self.bands[-1] + 1 if self.bands else len(self.ops)


def find_sequence(sg: StepGraph, onednn_later: bool = False) -> Sequence:
    """The chainable ops in the simulator's order. The rewrite links them in the topological order of the rewritten
    graph that follows this order as far as the plan's own edges allow (a weight's reads wait for its swap-in).

    On a CPU device the plan's swap ops join the chain as soon as they are ready: their copies are synchronous
    kernels, which the executor would otherwise queue behind the chain (a swap-out run late frees its tensor late).
    On a GPU they stay out: their copies run on their own streams and must overlap the chain. ``onednn_later``:
    oneDNN's layout pass rewrites the graph after the plan (then a CPU step is left in TF's order, see above)."""
    if not sg.ops:
        return Sequence()
    frame, device = _step_frame_and_device(sg)
    if onednn_later and _is_cpu(device):
        return Sequence(skipped=ONEDNN_SKIP)
    if frame:
        return Sequence(skipped=LOOP_SKIP)
    ops = tuple(n for n in sg.execution_order() if _chainable(sg, n, frame, device))
    return Sequence(ops, with_added=_is_cpu(device))


def find_bands(sg: StepGraph, ops: tuple[str, ...], sim: SimResult,
               contractions_alone: bool = True) -> tuple[int, ...]:
    """The band of each of ``ops`` (chainable ops in ``sim``'s order, as :func:`find_sequence` gives them): greedy
    runs of consecutive ops whose bound (see above) stays within ``sim``'s peak; with ``contractions_alone`` (a
    plan under a budget), each contraction a band of its own."""
    if not ops or sim.memory_curve is None or sim.op_start_s is None:
        return ()
    times, in_use = sim.memory_curve
    persistent = int(sim.peak_by_group.get("persistent", 0))
    grows = np.concatenate(([0], np.cumsum(np.maximum(np.diff(in_use, prepend=persistent), 0))))
    position = {name: i for i, name in enumerate(sim.order)}
    starts = np.searchsorted(times, sim.op_start_s[[position[n] for n in ops]], side="left")
    ends = np.append(starts[1:], len(times))  # a band's ops, and the unchained ops up to the next band's start
    alone = [contractions_alone and is_contraction(sg.ops[n].type) for n in ops]
    bands, band, first = [0], 0, 0
    for k in range(1, len(ops)):
        before = int(in_use[starts[first] - 1]) if starts[first] else persistent
        if alone[k] or alone[k - 1] or before + int(grows[ends[k]] - grows[starts[first]]) > sim.peak_bytes:
            band, first = band + 1, k
        bands.append(band)
    return tuple(bands)


def is_contraction(op_type: str) -> bool:
    """Whether ``op_type`` is a contraction (:data:`CONTRACTION_MARKERS`), whose kernel holds a workspace."""
    return any(marker in op_type for marker in CONTRACTION_MARKERS)


def accumulation_note(sg: StepGraph) -> str:
    """What the plan says of the step's in-place gradient sums (see above); "" when it has none."""
    n = sum(op.type == "TemporaryVariable" for op in sg.ops.values())
    if not n:
        return ""
    sums = "1 gradient sum is" if n == 1 else f"{n} gradient sums are"
    return (f"{sums} accumulated in place by Grappler's memory optimizer, in the order TF's threads "
            "finish their inputs: their rounding, and so the results, may differ from run to run, with or without "
            "Dymem")


def _is_cpu(device: str) -> bool:
    """Whether ``device`` (a TF device name, "" when unplaced) is a CPU."""
    return ":CPU:" in device.upper()
