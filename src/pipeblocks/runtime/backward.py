"""Backward passes of one stage: fused (BW) and split into input gradient (B) and weight gradient (W).

The split works on the autograd graph of the stage, so any stage module works unchanged:

* B runs the engine from the stage output (or loss) to the stage *input* only, with the
  graph retained. On the way, pre-hooks capture the output gradients of the "join" nodes:
  the nodes on the input path where a path to a parameter branches off (for a linear
  layer, its addmm node: the input path gets dX = dY·A now, the weight path needs dY).
* W runs the engine again from those join nodes, with their captured gradients, to the
  parameters only, and accumulates into `param.grad`. The join node is executed a second
  time, computing only its weight-side outputs, so no FLOPs are repeated for plain layers.
  Parameters reached through the same join nodes form one group and one engine call; when
  a group has several join nodes (a parameter used twice), a pre-hook pins each join node
  to its captured gradient so that nothing is counted twice.

Memory consequence (README, Definitions; a caveat of the graph split): after B this module
keeps only the join nodes, so every saved tensor reachable from them stays alive until W:
in practice all of the stage's activations except the region above the topmost join
node (on the last stage: the loss, e.g. cross-entropy's log-softmax). B therefore frees
little (M_W is close to M_B; `profile.profile_stage_memory` measures both per stage) and W
frees the rest. On a stage whose input needs no gradient (stage 0: token ids), B has no
work at all and W runs the whole backward from the output.

The partition (which nodes are on the input path, the join nodes and parameter groups) is
a function of the graph's structure alone, and a stage builds the same graph for every
microbatch. A `PartitionCache` (one per stage; the runtime's compute keeps one) remembers it
by the graph's structure: one walk of the graph lists its nodes with their children, the
kind of each node and, for leaves, which parameter or input they are; a graph equal in all
of that gets the remembered partition, mapped onto its own nodes, and anything else is
partitioned afresh. So the gradients are those of the uncached split, bit for bit.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightGradWork", "PartitionCache", "fused_backward", "input_backward"]


@dataclass
class _Group:
    """Parameters whose gradients flow through the same join nodes; `edges` are the
    parameters' gradient edges, found once in B (each lookup makes a view: about 10 µs)."""

    params: list[torch.nn.Parameter]
    nodes: list[Node]
    grads: list[tuple[torch.Tensor | None, ...] | None] = field(default_factory=list)
    edges: list[GradientEdge] = field(default_factory=list)


@dataclass
class WeightGradWork:
    """What B leaves for W: join nodes, their captured gradients, and the parameters.

    `keep_alive` holds the stage output when a join node is a Python autograd Function
    (whose Python object does not own its graph).
    """

    groups: list[_Group]
    keep_alive: torch.Tensor | None = None

    def run(self) -> None:
        """Compute the weight gradients and accumulate them into `param.grad`; frees the graph.
        The groups run last parameters first (a stage's later blocks before its earlier
        ones, the order a fused backward reaches them), so a block's gradients complete in
        the order a BW pass completes them: at block grain the DP reductions launched as
        each unit completes (`dp_units.GradReadiness`) follow the blocks in reverse, as the
        Program orders its REDUCE_GRADs and the simulator times them. Each parameter's
        gradient comes from its own group's engine call, so the order changes no value."""
        groups, self.groups = self.groups[::-1], []
        for number, group in enumerate(groups):
            edges: list[GradientEdge] = []
            grads: list[torch.Tensor] = []
            for node, captured in zip(group.nodes, group.grads):
                if captured is None:
                    continue
                for index, grad in enumerate(captured):
                    if grad is not None:
                        edges.append(GradientEdge(node, index))
                        grads.append(grad)
            if not edges:
                continue
            pins = []
            if len(group.nodes) > 1:
                for node, captured in zip(group.nodes, group.grads):
                    if captured is not None:
                        pins.append(node.register_prehook(_pin(captured)))
            # a leaf parameter by its gradient edge (its AccumulateGrad node, found in B); a
            # parameter that is not a leaf (a view of a gathered one) by the tensor, whose .grad
            # the engine fills only when it is named
            leaves = all(p.grad_fn is None for p in group.params)
            try:
                # Groups can share nodes below their joins when the input path is sparse (stage 0
                # with sequence chunks: only the K/V leaves need a gradient), so every engine call
                # but the last keeps the graph; it is freed when this work drops its nodes. Each
                # gradient is accumulated into `.grad` where it is computed, as a fused backward
                # does, so the call never holds all of the group's gradients at once.
                torch.autograd.backward(edges, grad_tensors=grads, inputs=group.edges if leaves else group.params,
                                        retain_graph=number < len(groups) - 1)
            finally:
                for pin in pins:
                    pin.remove()
        self.keep_alive = None


def _pin(captured: tuple[torch.Tensor | None, ...]):
    def hook(grad_outputs):
        return captured

    return hook


def fused_backward(output: torch.Tensor | Sequence[torch.Tensor], grad_output: torch.Tensor | Sequence | None,
                   inp: torch.Tensor | Sequence[torch.Tensor] | None) -> torch.Tensor | list[torch.Tensor] | None:
    """BW: accumulate all parameter gradients and return the gradient of `inp` (None if it needs none).

    Several roots (a stage with several floating outputs): `output` and `grad_output` are
    sequences, roots that need no gradient are skipped; several inputs: `inp` is a
    sequence and the result a list (zeros for an input the roots do not depend on).
    """
    if isinstance(output, torch.Tensor):
        if output.grad_fn is None:
            return None
        roots, grads = [output], [torch.ones_like(output) if grad_output is None else grad_output]
    else:
        pairs = [(o, g) for o, g in zip(output, grad_output, strict=True) if o.requires_grad]
        if not pairs:
            return None
        roots, grads = [o for o, _ in pairs], [g for _, g in pairs]
    inputs = [] if inp is None else [inp] if isinstance(inp, torch.Tensor) else list(inp)
    torch.autograd.backward(roots, grads)
    dxs = []
    for t in inputs:
        if not t.requires_grad:
            dxs.append(None)
            continue
        dx, t.grad = t.grad, None
        dxs.append(dx if dx is not None else torch.zeros_like(t))
    return dxs[0] if isinstance(inp, torch.Tensor) else None if inp is None else dxs


def input_backward(
    output: torch.Tensor | Sequence[torch.Tensor],
    grad_output: torch.Tensor | Sequence | None,
    inp: torch.Tensor | Sequence[torch.Tensor] | None,
    params: Sequence[torch.nn.Parameter],
    extra_inputs: Sequence[torch.Tensor] = (),
    *,
    partitions: PartitionCache | None = None,
) -> tuple[torch.Tensor | list[torch.Tensor] | None, WeightGradWork]:
    """B: return the gradient of `inp` and the work W will do later.

    Several roots or inputs as in `fused_backward` (several roots are joined into one
    scalar root, `_one_root`, so that W has one root node to start from).
    extra_inputs: leaf tensors whose gradient B must produce as well (with sequence chunks,
    the earlier chunks' K/V leaves, see sequence.py); it is accumulated into their `.grad`.
    partitions: the stage's `PartitionCache`, to reuse the partition of an earlier
    microbatch whose graph has the same structure (None: partition afresh).
    """
    if not isinstance(output, torch.Tensor):
        output, grad_output = _one_root(output, grad_output)
        if output is None:
            return None, WeightGradWork([])
    inputs = [] if inp is None else [inp] if isinstance(inp, torch.Tensor) else list(inp)
    root = output.grad_fn
    grad = torch.ones_like(output) if grad_output is None else grad_output
    trainable = [p for p in params if p.requires_grad]
    extras = [t for t in extra_inputs if t.requires_grad]
    needed = [t for t in inputs if t.requires_grad]
    if root is None or not trainable and not extras and not needed:
        return None, WeightGradWork([])
    targets = needed + extras
    if partitions is not None:
        groups = partitions.groups(root, targets, trainable)
    else:
        groups = _partition(_graph(root), root, targets, trainable)
    # The root's gradient is known without running the engine.
    root_grads: list[torch.Tensor | None] = [None] * max(1, _num_outputs(root, output))
    root_grads[output.output_nr] = grad
    captured: dict[Node, tuple[torch.Tensor | None, ...]] = {root: tuple(root_grads)}
    dxs: dict[int, torch.Tensor] = {}
    if targets:
        handles = []
        try:
            for group in groups:
                for node in group.nodes:
                    if node is not root:
                        handles.append(node.register_prehook(_capture(captured, node)))
            results = torch.autograd.grad([output], targets, grad_outputs=[grad], retain_graph=True, allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        for t, g in zip(needed, results):
            dxs[id(t)] = g if g is not None else torch.zeros_like(t)
        for leaf, g in zip(extras, results[len(results) - len(extras):]):
            if g is not None:
                leaf.grad = g if leaf.grad is None else leaf.grad + g
    for group in groups:
        group.grads = [captured.get(node) for node in group.nodes]
    python_nodes = any(isinstance(n, torch._C._FunctionBase) for g in groups for n in g.nodes)
    work = WeightGradWork(groups, keep_alive=output if python_nodes else None)
    if isinstance(inp, torch.Tensor):
        return dxs.get(id(inp)), work
    return (None if inp is None else [dxs.get(id(t)) for t in inputs]), work


def _partition(children: dict[Node, list[Node]], root: Node, targets: Sequence[torch.Tensor],
               params: list) -> list[_Group]:
    parents: dict[Node, list[Node]] = {}
    for node, kids in children.items():
        for kid in kids:
            parents.setdefault(kid, []).append(node)
    on_input_path = _reaches(children, parents, [get_gradient_edge(t).node for t in targets])
    on_input_path.add(root)
    return _param_groups(children, parents, on_input_path, params)


@dataclass(frozen=True)
class _Plan:
    """A partition by node positions in the walk: per group, its parameters (indices into
    the parameter list), its join nodes and its parameters' gradient-edge nodes."""

    groups: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...]

    def build(self, order: list[Node], params: list) -> list[_Group]:
        return [
            _Group([params[k] for k in members], [order[j] for j in joins], edges=[GradientEdge(order[j], 0)
                                                                                   for j in edge_nodes])
            for members, joins, edge_nodes in self.groups
        ]


class PartitionCache:
    """Remembered partitions of one stage's graph, by the graph's structure (module
    docstring). `hits` and `misses` count the lookups. At most `size` structures are kept
    (a sequence-chunk schedule builds one per chunk); a new parameter list starts afresh."""

    def __init__(self, size: int = 16) -> None:
        self.size = size
        self.hits = 0
        self.misses = 0
        self._plans: dict[tuple, _Plan] = {}
        self._param_ids: tuple[int, ...] = ()
        self._param_index: dict[int, int] = {}
        self._leaf_params = True

    def groups(self, root: Node, targets: Sequence[torch.Tensor], params: list) -> list[_Group]:
        ids = tuple(id(p) for p in params)
        if ids != self._param_ids:
            self._plans.clear()
            self._param_ids = ids
            self._param_index = {i: k for k, i in enumerate(ids)}
            # a parameter that is not a leaf has no AccumulateGrad node to recognise it by
            self._leaf_params = all(p.grad_fn is None for p in params)
        if not self._leaf_params or any(t.grad_fn is not None for t in targets):
            self.misses += 1
            return _partition(_graph(root), root, targets, params)
        order, kids, key, acc = _walk(root, {id(t): k for k, t in enumerate(targets)}, self._param_index)
        plan = self._plans.get(key)
        if plan is not None:
            self.hits += 1
            return plan.build(order, params)
        self.misses += 1
        children = {node: [order[j] for j in kids[i] if j >= 0] for i, node in enumerate(order)}
        groups = _partition(children, root, targets, params)
        position = {node: i for i, node in enumerate(order)}
        index = {id(p): k for k, p in enumerate(params)}
        if all(acc.get(index[id(p)]) == position[e.node] and e.output_nr == 0
               for g in groups for p, e in zip(g.params, g.edges)):
            if len(self._plans) >= self.size:
                self._plans.clear()
            self._plans[key] = _Plan(tuple(
                (tuple(index[id(p)] for p in g.params), tuple(position[n] for n in g.nodes),
                 tuple(position[e.node] for e in g.edges)) for g in groups))
        return groups


def _walk(root: Node, targets: dict[int, int], params: dict[int, int]) -> tuple[list[Node], list, tuple, dict]:
    """Every node reachable from root in breadth-first order; each node's children as
    positions (-1: no function); the structure key (per node: its type, its children, and
    for a leaf which parameter or target it is); parameter index -> its leaf's position."""
    order, position, kids, key, acc = [root], {root: 0}, [], [], {}
    accumulate = _accumulate_grad_type()
    i = 0
    while i < len(order):
        node = order[i]
        mine = []
        for fn, _ in node.next_functions:
            if fn is None:
                mine.append(-1)
                continue
            j = position.get(fn)
            if j is None:
                j = position[fn] = len(order)
                order.append(fn)
            mine.append(j)
        mine = tuple(mine)
        kids.append(mine)
        kind = type(node)
        if kind is accumulate:
            leaf = id(node.variable)
            k = params.get(leaf)
            if k is not None:
                acc[k] = i
                key.append((kind, mine, "p", k))
            else:
                key.append((kind, mine, "t", targets.get(leaf, -1)))
        else:
            key.append((kind, mine))
        i += 1
    return order, kids, tuple(key), acc


@functools.cache
def _accumulate_grad_type() -> type:
    leaf = torch.zeros(1, requires_grad=True)
    return type(get_gradient_edge(leaf).node)


def _one_root(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, None]:
    """One scalar root for several roots: the sum of (output * its gradient).sum(), whose
    gradient with respect to each output is exactly that output's gradient (1 * g). A single
    root with a graph is returned as it is; roots that need no gradient are skipped."""
    pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
    if not pairs:
        return None, None
    if len(pairs) == 1 and pairs[0][0].grad_fn is not None:
        return pairs[0]
    with torch.enable_grad():
        total = (pairs[0][0] * pairs[0][1]).sum()
        for o, g in pairs[1:]:
            total = total + (o * g).sum()
    return total, None


def _capture(store: dict, node: Node):
    def hook(grad_outputs):
        store[node] = tuple(grad_outputs)

    return hook


def _num_outputs(node: Node, output: torch.Tensor) -> int:
    metadata = getattr(node, "_input_metadata", None)
    return len(metadata) if metadata is not None else output.output_nr + 1


def _graph(root: Node) -> dict[Node, list[Node]]:
    """Children (next functions) of every node reachable from root."""
    children: dict[Node, list[Node]] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        if node in children:
            continue
        kids = [fn for fn, _ in node.next_functions if fn is not None]
        children[node] = kids
        stack.extend(k for k in kids if k not in children)
    return children


def _reaches(children: dict[Node, list[Node]], parents: dict[Node, list[Node]], targets: Sequence[Node]) -> set[Node]:
    """Nodes with a path to any of targets (the targets included)."""
    found = {t for t in targets if t in children}
    stack = list(found)
    while stack:
        node = stack.pop()
        for parent in parents.get(node, ()):
            if parent not in found:
                found.add(parent)
                stack.append(parent)
    return found


def _param_groups(children: dict[Node, list[Node]], parents: dict[Node, list[Node]], on_input_path: set[Node],
                  params: list) -> list[_Group]:
    """Group parameters by the input-path nodes their gradient paths leave from."""
    group_of: dict[Node, _Group] = {}
    groups: list[_Group] = []
    for param in params:
        edge = get_gradient_edge(param)
        acc = edge.node
        if acc not in children:
            continue  # this parameter did not take part in the forward
        joins: list[Node] = []
        seen = {acc}
        stack = [acc]
        while stack:
            node = stack.pop()
            for parent in parents.get(node, ()):
                if parent in seen:
                    continue
                seen.add(parent)
                if parent in on_input_path:
                    joins.append(parent)
                else:
                    stack.append(parent)
        merged: list[_Group] = []
        for join in joins:
            found = group_of.get(join)
            if found is not None and all(found is not g for g in merged):
                merged.append(found)
        group = merged[0] if merged else _Group([], [])
        if not merged:
            groups.append(group)
        for other in merged[1:]:
            group.params.extend(other.params)
            group.edges.extend(other.edges)
            for node in other.nodes:
                if node not in group.nodes:
                    group.nodes.append(node)
                group_of[node] = group
            groups.remove(other)
        group.params.append(param)
        group.edges.append(edge)
        for node in joins:
            if node not in group.nodes:
                group.nodes.append(node)
            group_of[node] = group
    return groups
