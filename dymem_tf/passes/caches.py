"""What the step pass keeps between instantiations: the last graph it read (:class:`CaptureCache`, for the re-plans
of one ``fit``) and the plans it made (:class:`PlanCache`, bounded, for every ``fit`` of the process).

Both are bounded, so that a process running any number of ``fit`` calls holds the same memory after the first few:
the capture cache holds one graph, the plan cache :data:`PLAN_CACHE_ENTRIES` plans.
"""
from __future__ import annotations

import collections
import threading

from dymem_tf.passes import graph_def_view

#: Plans kept process-wide: one model under a budget makes up to four (probe, calibrated, a placed plan's two
#: refinements) per graph, and a step retraced on a partial last batch has a second graph.
PLAN_CACHE_ENTRIES = 8


class CaptureCache:
    """The graph of the last instantiation the pass read, and the step graphs captured from it.

    Under a budget one ``fit`` instantiates the same train step two or three times (the probe's plan, the
    calibrated plan, a refined one), and TensorFlow hands the pass the same graph each time: it is read, captured
    and prepared for planning (:func:`~dymem_tf.planning.pipeline.prepare_step`) once. Callers that keep an entry
    must plan on copies of its step graph (the planning stages add edges and mark tensors in place). Only the last
    graph is kept: a large step's analysis holds hundreds of MiB.
    """

    def __init__(self) -> None:
        self._key: bytes | None = None
        self._groups: list = []
        self._graphs: dict = {}
        self._prepared: dict = {}
        self.hits = 0  # instantiations whose graph was read before

    def read(self, graph_def, key: bytes, outputs: bytes, keep: bool, split) -> list[tuple[int | None, list]]:
        """The graph's ops per training device (``split`` of its :class:`GraphView`), read again only for another
        graph than the last (``key``: its :func:`graph_key`); ``keep``: keep it (and what is captured from it) for
        the next call."""
        if key == self._key:
            self.hits += 1
            return self._groups
        groups = split(graph_def_view.GraphView(graph_def, outputs))
        self._key, self._groups = (key, groups) if keep else (None, [])
        self._graphs, self._prepared = {}, {}
        return groups

    def capture(self, entry: tuple, make):
        """``make()`` (a capture of one replica's ops), once per graph kept and ``entry`` (replica, batch sizes)."""
        if entry in self._graphs:
            return self._graphs[entry]
        result = make()
        if self._key is not None:
            self._graphs[entry] = result
        return result

    def prepared(self, key: tuple, prepare):
        """``prepare()`` (a :class:`~dymem_tf.planning.pipeline.PreparedStep` of a captured graph), made once per
        graph kept and ``key`` (the capture's entry and :func:`~dymem_tf.planning.pipeline.preparation_key`);
        the plans made from it must leave it unchanged, as :func:`~dymem_tf.planning.pipeline.finish_plan` does."""
        if key not in self._prepared:
            result = prepare()
            if self._key is None:
                return result
            self._prepared[key] = result
        return self._prepared[key]

    @property
    def holds_graph(self) -> bool:
        """Whether a graph is kept."""
        return self._key is not None


class PlanCache:
    """Plans by graph and request, least recently used first out, at most ``capacity`` of them; thread-safe.

    A value is whatever the pass needs to apply a plan again without planning (its planned steps and message)."""

    def __init__(self, capacity: int = PLAN_CACHE_ENTRIES):
        self.capacity = capacity
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0  # plans served again
        self.stored = 0  # plans made and kept

    def get(self, key):
        """The value kept for ``key`` (now the most recently used), or None."""
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
                self.hits += 1
            return value

    def put(self, key, value) -> None:
        """Keep ``value`` for ``key``, dropping the least recently used entry beyond the capacity."""
        with self._lock:
            self.stored += 1
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def graph_key(graph_def, outputs: bytes) -> bytes:
    """A digest of a graph and its inferred outputs: equal for the same graph offered again (a retrace of the same
    step, the next ``fit``'s train function)."""
    return graph_def_view.fingerprint(graph_def, outputs)


#: The process's plans: every ``StepPass`` shares them unless given its own.
SHARED_PLANS = PlanCache()
