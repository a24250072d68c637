"""Run a model as a torch.fx graph in pieces: the part a pruned group cannot change, once; the rest, per variant.

For a group, every graph node that reads one of the group's layers or parameters is *affected*; the affected
nodes and everything downstream of them form the *suffix*. All other nodes compute the same values whatever
channels the group loses, so the suffix's inputs from them (the *frontier*) are computed once per batch by an
unmasked walk through the graph, and only the suffix runs once per ratio. Values are freed after their last use,
so memory stays near that of a normal forward pass plus one suffix.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch
import torch.fx as fx
from torch import nn

INPLACE_SUFFIX = "_"

NodeValues: TypeAlias = dict[fx.Node, Any]
"""The values of graph nodes (tensors mostly, but a node may produce any Python value)."""


class UntraceableModel(Exception):
    """torch.fx cannot trace the model (data-dependent control flow, unsupported Python); use the reference engine."""


@dataclass
class SuffixPlan:
    """The part of the graph a group's removal changes, and what it reads from the rest.

    Attributes:
        nodes: The suffix, in execution order.
        frontier: Unaffected nodes whose values the suffix reads.
        ready: Index (in the full node list) after which every frontier value exists.
        clone: Frontier values the suffix modifies in place (they are copied for each run).
        release: For each suffix position, the values no longer needed after it.
        cost: Estimated seconds per batch of one suffix run (from :meth:`GraphRunner.profile`).
    """

    nodes: list[fx.Node]
    frontier: list[fx.Node]
    ready: int
    clone: set[fx.Node] = field(default_factory=set)
    release: list[list[fx.Node]] = field(default_factory=list)
    cost: float = 0.0


@dataclass
class Schedule:
    """The unmodified walk for a set of plans: per graph position, the node to run (None: not needed), the plans
    whose frontier is then complete, and the values no longer needed afterwards."""

    steps: list[tuple[fx.Node | None, list[SuffixPlan], list[fx.Node]]]


def _optional_arguments(model: nn.Module) -> dict[str, Any]:
    """The forward arguments after the first that have defaults (timm's ``attn_mask=None``), fixed at them so the
    traced graph has one input, the images, as the model is called during the analysis."""
    parameters = list(inspect.signature(model.forward).parameters.values())[1:]
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty and p.kind not in (
        inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)}  # fmt: skip


class GraphRunner:
    """A model traced with torch.fx (sharing the model's modules and parameters) and run node by node."""

    def __init__(self, model: nn.Module) -> None:
        try:
            self.module = fx.symbolic_trace(model, concrete_args=_optional_arguments(model))
        except Exception as error:  # tracing failures come in many types; all mean "not traceable"
            first_line = str(error).splitlines()[0] if str(error) else ""
            raise UntraceableModel(f"{type(error).__name__}: {first_line}") from error
        self.nodes: list[fx.Node] = list(self.module.graph.nodes)
        self.index = {node: i for i, node in enumerate(self.nodes)}
        self.output = next(node for node in self.nodes if node.op == "output")
        inputs = [node for node in self.nodes if node.op == "placeholder"]
        if not inputs or any(not node.args for node in inputs[1:]):
            raise UntraceableModel("the fast engine supports models with exactly one input")
        self.images = inputs[0]  # the other placeholders are the fixed optional arguments, fed their defaults
        self.node_cost = dict.fromkeys(self.nodes, 1.0)
        self.called: dict[fx.Node, nn.Module] = {
            node: self.module.get_submodule(str(node.target)) for node in self.nodes if node.op == "call_module"
        }  # looked up once: every plan and every executed node needs its module

    def _input(self, node: fx.Node, images: torch.Tensor) -> Any:
        """The value of a placeholder: the images, or the default of an optional argument."""
        return images if node is self.images else node.args[0]

    def plan(self, modules: Iterable[nn.Module], parameters: Iterable[torch.Tensor]) -> SuffixPlan | None:
        """The suffix of a group made of ``modules`` and bare ``parameters``; None if it does not reach the output."""
        module_set, parameter_ids = set(modules), {id(p) for p in parameters}
        owned = {id(p) for m in module_set for p in m.parameters(recurse=False)} | parameter_ids
        affected = [node for node in self.nodes if self._reads(node, module_set, owned)]
        suffix = _reachable(affected, lambda node: node.users)
        if self.output not in suffix:
            return None
        ordered = [node for node in self.nodes if node in suffix]
        frontier = [node for node in self.nodes if node not in suffix and any(u in suffix for u in node.users)]
        plan = SuffixPlan(ordered, frontier, max(self.index[f] for f in frontier))
        plan.clone = {
            arg
            for node in ordered
            if _in_place(self.module, node)
            for arg in node.args[:1]
            if isinstance(arg, fx.Node) and arg in frontier
        }
        plan.release = _releases(ordered, keep={self.output})
        plan.cost = sum(self.node_cost[node] for node in ordered)
        return plan

    def runs_all(self, plan: SuffixPlan, modules: Iterable[nn.Module]) -> bool:
        """Whether every one of ``modules`` is called inside the suffix of ``plan``."""
        called = {self.called[node] for node in plan.nodes if node.op == "call_module"}
        return all(module in called for module in modules)

    def _reads(self, node: fx.Node, modules: set[nn.Module], owned: set[int]) -> bool:
        if node.op == "call_module":
            return self.called[node] in modules
        if node.op == "get_attr":
            return id(self._attribute(str(node.target))) in owned
        return False

    def _attribute(self, target: str) -> Any:
        return functools.reduce(getattr, target.split("."), self.module)

    def execute(self, node: fx.Node, env: NodeValues) -> Any:
        """Compute one node from the values of its inputs in ``env``."""
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        if node.op == "call_module":
            return self.called[node](*args, **kwargs)
        if node.op == "call_function":
            return node.target(*args, **kwargs)  # type: ignore[operator]
        if node.op == "call_method":
            return getattr(args[0], str(node.target))(*args[1:], **kwargs)
        if node.op == "get_attr":
            return self._attribute(str(node.target))
        if node.op == "output":
            return args[0]
        raise ValueError(f"cannot execute node {node.op} {node.target}")

    def schedule(self, plans: Sequence[SuffixPlan]) -> Schedule:
        """Precompute, for a set of plans, which nodes the unmodified walk must run and when values can go."""
        needed = _ancestors({f for plan in plans for f in plan.frontier})
        waiting = sorted(plans, key=lambda p: p.ready)
        hold: dict[fx.Node, int] = {}
        for plan in waiting:
            for node in plan.frontier:
                hold[node] = max(hold.get(node, -1), plan.ready)
        last_use = {
            node: max([self.index[u] for u in node.users if u in needed] + [hold.get(node, -1), self.index[node]])
            for node in needed
        }
        stop = waiting[-1].ready + 1 if waiting else 0
        steps = []
        for position, node in enumerate(self.nodes[:stop]):
            ready = [plan for plan in waiting if plan.ready == position]
            free = [n for n in needed if last_use[n] == position]
            steps.append((node if node in needed else None, ready, free))
        return Schedule(steps)

    def walk(self, inputs: torch.Tensor, schedule: Schedule, visit: Callable[[SuffixPlan, NodeValues], None]) -> None:
        """Run the unmodified graph on ``inputs`` just far enough to produce every plan's frontier; call
        ``visit(plan, frontier_values)`` as soon as a plan's frontier is complete."""
        env: NodeValues = {}
        for node, ready, free in schedule.steps:
            if node is not None:
                env[node] = self._input(node, inputs) if node.op == "placeholder" else self.execute(node, env)
            for plan in ready:
                visit(plan, {f: env[f] for f in plan.frontier})
            for done in free:
                del env[done]

    def run_suffix(
        self, plan: SuffixPlan, frontier: NodeValues, capture: dict[fx.Node, list[Any]] | None = None
    ) -> torch.Tensor:
        """Run a plan's suffix from its frontier values and return the model output; the values of the nodes in
        ``capture`` are appended to their lists (copied when a later node would change them in place)."""
        env = {node: value.clone() if node in plan.clone else value for node, value in frontier.items()}
        for node, release in zip(plan.nodes, plan.release, strict=True):
            env[node] = self.execute(node, env)
            if capture is not None and node in capture:
                capture[node].append(env[node].clone() if node in self._modified_in_place else env[node])
            for done in release:
                env.pop(done, None)
        logits: torch.Tensor = env[self.output]
        return logits

    def cut_points(self) -> list[fx.Node]:
        """The nodes every path from the input to the output runs through, in order (the input first): a run can
        start from such a node's value alone (parameters read by later nodes are looked up again)."""
        cuts, furthest = [], -1
        for position, node in enumerate(self.nodes):
            if furthest <= position and node.op in ("placeholder", "call_module", "call_function", "call_method"):
                cuts.append(node)
            if node.op != "get_attr":
                furthest = max([furthest, position, *(self.index[user] for user in node.users)])
        return cuts

    def tail(self, cut: fx.Node) -> SuffixPlan:
        """The plan that runs everything after the cut point ``cut`` (see :meth:`cut_points`) from its value."""
        start = self.index[cut]
        attributes = [
            n for n in self.nodes[:start] if n.op == "get_attr" and any(self.index[u] > start for u in n.users)
        ]
        ordered = attributes + self.nodes[start + 1 :]
        plan = SuffixPlan(ordered, [cut], start)
        plan.clone = {cut} if cut in self._modified_in_place else set()
        plan.release = _releases(ordered, keep={self.output})
        plan.cost = sum(self.node_cost[node] for node in ordered)
        return plan

    @functools.cached_property
    def _modified_in_place(self) -> set[fx.Node]:
        """Nodes whose value a later node changes in place."""
        return {node.args[0] for node in self.nodes if _in_place(self.module, node) and node.args
                and isinstance(node.args[0], fx.Node)}  # fmt: skip

    def profile(self, inputs: torch.Tensor, repeats: int = 2) -> float:
        """Time every node on ``inputs`` (best of ``repeats`` runs) to estimate suffix costs; returns the total."""
        best = dict.fromkeys(self.nodes, float("inf"))
        sync: Callable[[], None] = torch.cuda.synchronize if inputs.is_cuda else (lambda: None)
        with torch.inference_mode():
            for _ in range(repeats):
                env: NodeValues = {}
                for node in self.nodes:
                    start = time.perf_counter()
                    env[node] = self._input(node, inputs) if node.op == "placeholder" else self.execute(node, env)
                    sync()
                    best[node] = min(best[node], time.perf_counter() - start)
        self.node_cost = best
        return sum(best.values())


def _in_place(module: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` may modify its first argument in place (inplace modules/kwargs, ``x.add_()``-style)."""
    if node.op == "call_module":
        return bool(getattr(module.get_submodule(str(node.target)), "inplace", False))
    if node.kwargs.get("inplace"):
        return True
    name = getattr(node.target, "__name__", str(node.target))
    return node.op in ("call_method", "call_function") and name.endswith(INPLACE_SUFFIX) and not name.endswith("__")


def _ancestors(nodes: set[fx.Node]) -> set[fx.Node]:
    return _reachable(nodes, lambda node: node.all_input_nodes)


def _reachable(start: Iterable[fx.Node], step: Callable[[fx.Node], Iterable[fx.Node]]) -> set[fx.Node]:
    """``start`` and every node reached from it by repeating ``step`` (users: the suffix; inputs: the ancestors)."""
    seen: set[fx.Node] = set()
    stack = list(start)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(step(node))
    return seen


def _releases(ordered: Sequence[fx.Node], keep: set[fx.Node]) -> list[list[fx.Node]]:
    """For each position of ``ordered``, the values (its own or frontier inputs) last read there."""
    position = {node: i for i, node in enumerate(ordered)}
    last: dict[fx.Node, int] = {}
    for i, node in enumerate(ordered):
        for source in node.all_input_nodes:
            last[source] = i
        last.setdefault(node, i)
    for node in ordered:
        users_inside = [position[u] for u in node.users if u in position]
        if users_inside:
            last[node] = max(users_inside)
    release: list[list[fx.Node]] = [[] for _ in ordered]
    for node, i in last.items():
        if node not in keep:
            release[i].append(node)
    return release
