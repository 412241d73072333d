"""PIE-P's model tree (paper §4, "Model Tree Abstraction"), built from a loaded model's module
structure. No vLLM imports: the model is read as a plain `torch.nn.Module` and vLLM's layers are
recognised by what they hold, not by their class names:

- decoder layers: the `ModuleList` with the most parameter tensors whose entries share one class;
  placeholders of layers held by other pipeline stages (parameterless) are skipped;
- attention: the child of a layer whose subtree holds an attention kernel (a module with
  `impl` and `head_size`, as vLLM's `Attention`);
- norm: a child without children whose only weight is one vector of the hidden size;
- MLP: the remaining children with parameters, taken together (Llama's `mlp`, OPT's `fc1`,
  `fc2`); a node spans from its first module's call to its last one's return;
- an MoE block inside the MLP: its fused experts (a module with `top_k` and `global_num_experts`
  or `num_experts`) as an `experts` node, the router (a 2-D weight with one row per expert) as
  `router` and a shared expert as `shared_expert`; router and shared expert are children of the
  experts node when vLLM calls them from inside it (the fused layer holds them), else of the
  MLP node, so that every parent's span contains its children's;
- embedding: modules outside the layers with a `num_embeddings` attribute and a 2-D weight, in
  the module that holds the layers (token and learned position embeddings together);
- final norm: a norm outside the layers in that same module;
- logits: a parameterless module of the top model that knows `vocab_size` and
  `org_vocab_size` (vLLM's `LogitsProcessor`; `lm_head` itself is never called).

Communication nodes come from where the model will communicate: an all-reduce after every node
whose subtree holds a module with `reduce_results` true and `tp_size > 1` (row-parallel
projections, vocab-parallel embedding), two all-to-alls after an experts node under expert
parallelism (`use_ep`: `{experts}@dispatch`, `{experts}@combine`), a gather or all-gather
after the logits under tensor parallelism, a point-to-point node at each pipeline-stage
boundary, and an all-gather at the tail under data parallelism. Each has a `transfer` and a
`wait` child.
Node ids: module nodes `embedding`, `layers.{i}`, `layers.{i}.{attribute}`, `final_norm`,
`logits`; communication nodes `{anchor}@{op}` (e.g. `layers.0.self_attn@all_reduce`),
`pp@send_recv[{a}-{b}]`, `dp@all_gather`; their children `{id}/transfer` and `{id}/wait`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is needed only to read a loaded model (from_module)
    from torch import nn

MODULE_TYPES = ("embedding", "attention", "mlp", "norm", "final_norm", "logits", "experts",
                "router", "shared_expert")
COMM_TYPES = ("all_reduce", "all_gather", "gather", "send_recv", "all_to_all")


@dataclass(frozen=True)
class ParallelLayout:
    """Where this rank sits: tensor, pipeline and data parallel degrees and its ranks."""

    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


@dataclass
class TreeNode:
    id: str
    type: str  # model | layer | one of MODULE_TYPES | one of COMM_TYPES | transfer | wait
    level: str  # model | block | module | communication
    layer: int | None = None
    children: list[str] = field(default_factory=list)
    modules: tuple[str, str] | None = None  # qualified names of the first and last module
    group: str | None = None  # tp | pp | dp for communication nodes
    stage: int = 0  # pipeline stage that runs it (both stages for a stage boundary: the lower)


class TreeError(ValueError):
    """The model's structure is not one the tree builder recognises."""


def _params(module: nn.Module) -> int:
    # Registered parameter tensors, not their sizes: vLLM's CPU linear layers move their
    # weights into packed kernels and leave empty parameters behind.
    return sum(1 for _ in module.parameters())


def _is_norm(module: nn.Module, hidden: int) -> bool:
    import torch
    if any(True for _ in module.children()):
        return False
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.numel() == hidden


def _is_embedding(module: nn.Module) -> bool:
    import torch
    weight = getattr(module, "weight", None)
    return hasattr(module, "num_embeddings") and isinstance(weight, torch.Tensor) \
        and weight.dim() == 2


def _holds_attention_kernel(module: nn.Module) -> bool:
    return any(hasattr(m, "impl") and hasattr(m, "head_size") for m in module.modules())


def _reduces(module: nn.Module) -> bool:
    return any(getattr(m, "reduce_results", False) is True and getattr(m, "tp_size", 1) > 1
               for m in module.modules())


def _find_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    from torch import nn
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        real = [m for m in module if _params(m) > 0]
        if not real or len({type(m) for m in real}) != 1:
            continue
        if not _holds_attention_kernel(real[0]):
            continue
        size = sum(_params(m) for m in real)
        if best is None or size > best[0]:
            best = (size, name, module)
    if best is None:
        raise TreeError("no decoder-layer list found (a ModuleList of identical blocks "
                        "holding attention)")
    return best[1], best[2]


def _hidden_size(layer: nn.Module) -> int:
    import torch
    for module in layer.children():
        weight = getattr(module, "weight", None)
        if not any(True for _ in module.children()) and isinstance(weight, torch.Tensor) \
                and weight.dim() == 1:
            return int(weight.numel())
    raise TreeError(f"no norm found in decoder layer {type(layer).__name__}")


class ModelTree:
    """The nodes of one model (or of one pipeline stage), in execution order within a parent."""

    def __init__(self, nodes: Iterable[TreeNode], root: str = "model", architecture: str = "",
                 layout: ParallelLayout = ParallelLayout()):
        self.nodes: dict[str, TreeNode] = {n.id: n for n in nodes}
        self.root = root
        self.architecture = architecture
        self.layout = layout
        if root not in self.nodes:
            raise TreeError("tree without a root")

    # ---------------------------------------------------------------- building
    @classmethod
    def from_module(cls, model: nn.Module, layout: ParallelLayout = ParallelLayout(),
                    architecture: str = "") -> ModelTree:
        """The tree of the part of `model` this rank runs (its pipeline stage)."""
        layers_name, layers = _find_layers(model)
        base_name = layers_name.rpartition(".")[0]
        base = model.get_submodule(base_name) if base_name else model
        prefix = f"{layers_name}."
        stage = layout.pp_rank
        tp = layout.tp_size > 1
        nodes: list[TreeNode] = []
        root = TreeNode("model", "model", "model", stage=stage)
        nodes.append(root)

        def add(parent: TreeNode, node: TreeNode, comm_after: nn.Module | None = None) -> None:
            parent.children.append(node.id)
            nodes.append(node)
            if comm_after is not None and tp and _reduces(comm_after):
                add_comm(parent, node.id, "all_reduce", "tp", node.layer)

        def add_comm(parent: TreeNode, anchor: str, op: str, group: str, layer: int | None,
                     node_id: str | None = None) -> None:
            comm = TreeNode(node_id or f"{anchor}@{op}", op, "communication", layer=layer,
                            group=group, stage=stage)
            for part in ("transfer", "wait"):
                sub = TreeNode(f"{comm.id}/{part}", part, "communication", layer=layer,
                               group=group, stage=stage)
                comm.children.append(sub.id)
                nodes.append(sub)
            parent.children.append(comm.id)
            nodes.append(comm)

        # Embedding: only the first stage embeds (a last stage may hold tied weights unused).
        real_layers = [(i, m) for i, m in enumerate(layers) if _params(m) > 0]
        if not real_layers:
            raise TreeError("this pipeline stage holds no decoder layer")
        hidden = _hidden_size(real_layers[0][1])
        base_children = [(n, m) for n, m in base.named_children() if m is not layers]
        if layout.first_stage:
            embeds = [(n, m) for n, m in base_children if _is_embedding(m)]
            if not embeds:
                raise TreeError("first pipeline stage without an embedding module")
            node = TreeNode("embedding", "embedding", "module", stage=stage,
                            modules=(_qual(base_name, embeds[0][0]), _qual(base_name,
                                                                           embeds[-1][0])))
            add(root, node, comm_after=embeds[0][1])
        for index, layer in real_layers:
            block = TreeNode(f"layers.{index}", "layer", "block", layer=index, stage=stage)
            root.children.append(block.id)
            nodes.append(block)
            mlp_parts: list[tuple[str, nn.Module]] = []
            entries: list[tuple[TreeNode, nn.Module | None] | None] = []  # None: the MLP's slot
            for name, child in layer.named_children():
                qual = f"{prefix}{index}.{name}"
                if _holds_attention_kernel(child):
                    entries.append((TreeNode(f"layers.{index}.{name}", "attention", "module",
                                             layer=index, modules=(qual, qual), stage=stage),
                                    child))
                elif _is_norm(child, hidden):
                    entries.append((TreeNode(f"layers.{index}.{name}", "norm", "module",
                                             layer=index, modules=(qual, qual), stage=stage),
                                    None))
                elif _params(child) > 0:
                    if not mlp_parts:
                        entries.append(None)
                    mlp_parts.append((name, child))
            if not any(e is not None and e[0].type == "attention" for e in entries):
                raise TreeError(f"decoder layer {index} ({type(layer).__name__}) holds no "
                                "attention kernel")
            if not mlp_parts:
                raise TreeError(f"decoder layer {index} ({type(layer).__name__}) has no MLP")
            first, last = mlp_parts[0][0], mlp_parts[-1][0]
            mlp = TreeNode(f"layers.{index}.{first if first == last else 'mlp'}", "mlp",
                           "module", layer=index, stage=stage,
                           modules=(f"{prefix}{index}.{first}", f"{prefix}{index}.{last}"))
            reducing = next((m for _, m in mlp_parts if _reduces(m)), mlp_parts[-1][1])
            for entry in entries:
                add(block, *(entry if entry is not None else (mlp, reducing)))
            if len(mlp_parts) == 1:
                _add_moe_parts(mlp, mlp_parts[0][1], f"{prefix}{index}.{first}", add, add_comm,
                               stage)
        if layout.last_stage:
            norms = [(n, m) for n, m in base_children if _is_norm(m, hidden)]
            if not norms:
                raise TreeError("last pipeline stage without a final norm")
            qual = _qual(base_name, norms[-1][0])
            add(root, TreeNode("final_norm", "final_norm", "module", modules=(qual, qual),
                               stage=stage))
            logits = [(n, m) for n, m in model.named_children()
                      if hasattr(m, "vocab_size") and hasattr(m, "org_vocab_size")
                      and _params(m) == 0]
            if not logits:
                raise TreeError("no logits processor (a module with vocab_size and "
                                "org_vocab_size) at the top of the model")
            add(root, TreeNode("logits", "logits", "module", stage=stage,
                               modules=(logits[0][0], logits[0][0])))
            if tp:
                op = "all_gather" if getattr(logits[0][1], "use_all_gather", False) else "gather"
                add_comm(root, "logits", op, "tp", None)
        if layout.pp_size > 1:
            # The boundary after this stage (and the one before it) run on this rank.
            for a in (stage - 1, stage):
                if 0 <= a < layout.pp_size - 1:
                    add_comm(root, "pp", "send_recv", "pp", None,
                             node_id=f"pp@send_recv[{a}-{a + 1}]")
        if layout.dp_size > 1 and layout.last_stage:
            add_comm(root, "dp", "all_gather", "dp", None)
        return cls(nodes, architecture=architecture, layout=layout)

    # ---------------------------------------------------------------- queries
    def __iter__(self) -> Iterator[TreeNode]:
        return iter(self.nodes.values())

    def __len__(self) -> int:
        return len(self.nodes)

    def __getitem__(self, node_id: str) -> TreeNode:
        return self.nodes[node_id]

    def module_nodes(self) -> list[TreeNode]:
        return [n for n in self if n.modules is not None]

    def comm_nodes(self) -> list[TreeNode]:
        return [n for n in self if n.type in COMM_TYPES]

    def leaves(self) -> list[TreeNode]:
        return [n for n in self if not n.children]

    def parent_of(self, node_id: str) -> str | None:
        for node in self:
            if node_id in node.children:
                return node.id
        return None

    def comm_node_for(self, op: str, group: str, enclosing: str | None,
                      rank_in_group: int, peer: int | None) -> str | None:
        """The communication node a collective span belongs to, or None if the tree has none:
        tensor-parallel calls by the module they ran in, pipeline sends and receives by the
        stage pair, data-parallel calls at the tail."""
        kind = group.split(":", 1)[0]
        if kind == "pp" and op in ("send", "recv") and peer is not None:
            lo, hi = sorted((rank_in_group, peer))
            node_id = f"pp@send_recv[{lo}-{hi}]"
        elif kind == "dp":
            node_id = "dp@all_gather"
        elif enclosing is not None:
            node_id = f"{enclosing}@{op}"
        else:
            return None
        return node_id if node_id in self.nodes else None

    # ---------------------------------------------------------------- (de)serialising
    def to_dict(self) -> dict[str, Any]:
        return {"root": self.root, "architecture": self.architecture,
                "layout": asdict(self.layout),
                "nodes": [{**asdict(n), "modules": list(n.modules) if n.modules else None}
                          for n in self]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelTree:
        nodes = []
        for raw in data["nodes"]:
            raw = dict(raw)
            raw["modules"] = tuple(raw["modules"]) if raw.get("modules") else None
            nodes.append(TreeNode(**raw))
        return cls(nodes, data.get("root", "model"), data.get("architecture", ""),
                   ParallelLayout(**data.get("layout", {})))

    @classmethod
    def merge(cls, trees: Iterable[ModelTree]) -> ModelTree:
        """One tree from the stage trees of a pipeline (or identical tensor-parallel ranks):
        nodes by id, the root's children ordered by stage and then as each stage listed them."""
        trees = sorted(trees, key=lambda t: t.layout.pp_rank)
        if not trees:
            raise TreeError("no trees to merge")
        nodes: dict[str, TreeNode] = {}
        root_children: list[str] = []
        for tree in trees:
            for node in tree:
                if node.id == tree.root:
                    continue
                if node.id not in nodes:
                    nodes[node.id] = TreeNode(**{**asdict(node), "children": list(node.children),
                                                 "modules": node.modules})
            for child in tree[tree.root].children:
                if child not in root_children:
                    root_children.append(child)
        layout = trees[0].layout
        root = TreeNode("model", "model", "model", children=root_children)
        return cls([root, *nodes.values()], architecture=trees[0].architecture,
                   layout=ParallelLayout(layout.tp_size, layout.pp_size, layout.dp_size))

    def render(self) -> str:
        """An indented listing, for logs and the spans CLI."""
        lines: list[str] = []

        def walk(node_id: str, depth: int) -> None:
            node = self.nodes[node_id]
            lines.append(f"{'  ' * depth}{node.id} [{node.type}]")
            for child in node.children:
                walk(child, depth + 1)

        walk(self.root, 0)
        return "\n".join(lines)


def _is_fused_experts(module: nn.Module) -> bool:
    return hasattr(module, "top_k") and (hasattr(module, "global_num_experts")
                                         or hasattr(module, "num_experts"))


def _experts_count(module: nn.Module) -> int:
    return int(getattr(module, "global_num_experts", None) or getattr(module, "num_experts"))


def _add_moe_parts(mlp: TreeNode, block: nn.Module, qual: str, add: Any, add_comm: Any,
                   stage: int) -> None:
    """Children of an MLP node that is an MoE block (module docstring); nothing otherwise."""
    experts = [(n, m) for n, m in block.named_children()
               if any(_is_fused_experts(x) for x in m.modules())]
    if len(experts) != 1:
        return
    name, holder = experts[0]
    fused = next(x for x in holder.modules() if _is_fused_experts(x))
    n_experts = _experts_count(fused)
    inside = set(map(id, holder.modules()))
    layer = mlp.layer
    node = TreeNode(f"{mlp.id}.{name}", "experts", "module", layer=layer, stage=stage,
                    modules=(f"{qual}.{name}", f"{qual}.{name}"))
    parts: list[tuple[TreeNode, bool]] = []
    for child_name, child in block.named_children():
        if child is holder or not any(True for _ in child.parameters()):
            continue
        if _rows(child) == n_experts:
            kind = "router"
        elif "shared_expert" in child_name and _rows(child) != 1:
            kind = "shared_expert"
        else:
            continue
        parts.append((TreeNode(f"{mlp.id}.{child_name}", kind, "module", layer=layer,
                               stage=stage, modules=(f"{qual}.{child_name}",
                                                     f"{qual}.{child_name}")),
                      id(child) in inside or _held_by(holder, child)))
    for part, nested in parts:
        if not nested:
            add(mlp, part)
    add(mlp, node)
    for part, nested in parts:
        if nested:
            add(node, part)
    if getattr(fused, "use_ep", False):  # dispatch and combine run inside the experts' span
        for op in ("dispatch", "combine"):
            add_comm(mlp, node.id, "all_to_all", "ep", layer, node_id=f"{node.id}@{op}")


def _rows(module: nn.Module) -> int | None:
    """Output rows of a linear layer: its declared output size (vLLM's CPU layers pack their
    weights away), else its 2-D weight's first dimension."""
    for attr in ("output_size", "out_features"):
        value = getattr(module, attr, None)
        if isinstance(value, int):
            return value
    weight = getattr(module, "weight", None)
    shape = getattr(weight, "shape", ())
    return int(shape[0]) if len(shape) == 2 else None


def _held_by(fused: nn.Module, child: nn.Module) -> bool:
    """Whether the fused experts layer keeps a reference to `child` (vLLM passes the router
    and shared expert in, and calls them from its own forward) without registering it."""
    seen = [fused.__dict__, *(vars(v) for v in fused.__dict__.values()
                              if hasattr(v, "__dict__") and not isinstance(v, type))]
    return any(v is child for d in seen for v in d.values())


def _qual(base: str, name: str) -> str:
    return f"{base}.{name}" if base else name
